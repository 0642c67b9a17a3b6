"""Best-first tree growth (speculative/bestfirst.py) on a tiny random model: the tree holds the candidates of
the greatest cumulative probability among those its fed nodes offered, each with the probability the draft
gives it alone (so the batched forwards see exactly their own ancestors), and the drafter keeps the
accepted nodes' KV entries after a verdict."""

import pytest
import torch

from common.settings import TOP_K, SamplingConfig, TreeConfig
from models.transformer import Transformer
from formats.weights import TensorWeights, random_tensors
from speculative.drafter import Drafter
from speculative.tree import ROOT, TokenTree
from tests.conftest import TINY

PROMPT = [5, 9, 2, 7, 3, 11, 4, 8, 6, 10]


def _model(seed: int) -> Transformer:
    args = TINY["qwen"]
    # a larger scale than the default: peaked distributions, so the tree has chains as well as siblings
    return Transformer(args, TensorWeights(args, random_tensors(args, seed, scale=2.0), "fp32"))


def _alone(model: Transformer, ids: list[int]) -> torch.Tensor:
    """The draft's next-token distribution after `ids`, from a fresh cache: no tree, no batching."""
    cache = model.new_cache(64)
    logits = model.forward(torch.tensor(ids), torch.arange(len(ids)), cache, logits_rows=slice(-1, None))[0]
    return torch.softmax(logits.float(), -1)


def test_keep_renumbers_a_subtree():
    t = TokenTree(9)
    a = t.add(1, ROOT, 0.6)
    t.add(2, ROOT, 0.3)
    c = t.add(3, a, 0.5)
    t.add(4, a, 0.3)
    t.add(6, c, 0.8)
    index = t.keep([0, 2, 4])
    assert index == {0: 0, 2: 1, 4: 2}
    assert [n.token for n in t.nodes] == [1, 3, 6] and [n.parent for n in t.nodes] == [ROOT, 0, 1]
    assert t.root_children == [0] and t.children(0) == [1] and t.children(1) == [2]
    assert t.nodes[2].cum == pytest.approx(0.6 * 0.5 * 0.8)
    assert t.proposal().worth == pytest.approx((0.6, 0.3, 0.24))  # as the governor gets them: greatest first


@pytest.mark.parametrize("seed,budget", [(1, 8), (2, 16), (3, 5), (4, 32)])  # 32: four candidates a forward
def test_a_best_first_tree_holds_the_likeliest_candidates_with_their_own_probabilities(seed, budget):
    model = _model(seed)
    d = Drafter(model, SamplingConfig(), TreeConfig(width=budget, trie=False, growth="best"))
    d.start(PROMPT, 128)
    d.push([12])
    tree = d.build_tree()
    t = tree.tree
    assert len(t) == budget and tree.forwards >= 2  # the root's pass, then batches of the best candidates
    worst = min(n.cum for n in t.nodes)
    context = PROMPT + [12]
    for i, n in enumerate(t.nodes):
        path = t.tokens_of(t.path(i))
        q = _alone(model, context + path[:-1])
        assert n.prob == pytest.approx(float(q[n.token]), rel=1e-4, abs=1e-6)
        if n.parent != ROOT:
            assert n.cum <= t.nodes[n.parent].cum
    for node in [ROOT] + [i for i, n in enumerate(t.nodes) if n.fed]:
        up = 1.0 if node == ROOT else t.nodes[node].cum
        prefix = [] if node == ROOT else t.tokens_of(t.path(node))
        q = _alone(model, context + prefix)
        kids = {t.nodes[c].token for c in t.children(node)}
        for tok in torch.topk(q, TOP_K).indices.tolist():  # a candidate it offered and the tree left out ...
            if tok not in kids:
                assert up * float(q[tok]) <= worst * (1 + 1e-4)  # ... is worth no more than any node kept


def test_the_drafter_keeps_the_accepted_nodes_of_a_best_first_tree():
    """After a verdict on a best-first tree, the draft's cache holds the accepted nodes it ran on (each from
    its own row of a batched forward), and the next tree's nodes have the probabilities the draft gives
    the committed text alone."""
    model = _model(4)
    d = Drafter(model, SamplingConfig(), TreeConfig(width=12, trie=False, growth="best"))
    d.start(PROMPT, 128)
    d.push([12])
    first = d.build_tree()
    t = first.tree
    deepest = max((i for i, n in enumerate(t.nodes) if n.fed), key=lambda i: t.nodes[i].depth)
    path = t.path(deepest)
    accepted = t.tokens_of(path)
    assert len(path) >= 2
    d.advance(first, path, accepted + [13])
    assert d.cache.length == len(PROMPT) + 1 + len(path) and d.pending == [13]
    t = d.build_tree().tree
    context = PROMPT + [12] + accepted + [13]
    for i, n in enumerate(t.nodes):
        q = _alone(model, context + t.tokens_of(t.path(i))[:-1])
        assert n.prob == pytest.approx(float(q[n.token]), rel=1e-4, abs=1e-6)


def test_the_governor_plays_the_widest_tree_where_verification_costs_the_same_at_every_width():
    """Under a budget the disk sets a verification's time whatever its rows: a best-first tree of 32 holds the 16
    best nodes of a tree of 16 and more, so it accepts more for the same price. One measured tree of 32 tells
    the governor what each smaller budget's best nodes are worth (scaled by how often the draft's beliefs held),
    and it keeps playing 32, where the chain formula (acceptance per depth) saw no gain past the trees' depth."""
    from common.settings import PLAIN, Arm
    from speculative.governor import CostModel, Cycle, Governor
    from tests.speculative.test_tree_policy import play

    sizes = tuple(Arm("draft", n) for n in (8, 16, 32))
    g = Governor(arms=(PLAIN, *sizes), start=Arm("draft", 32), model=CostModel(worth_priced=True))
    worth = tuple(0.9**k / (1 + k // 8) for k in range(32))  # a chain's worth falls; the siblings' worth adds up
    chosen = play(  # every budget accepts its best nodes' worth, at the disk's 0.7 s a verification
        g,
        24,
        0.7,
        lambda a: Cycle(
            0.005 * a.size, 0.7, a.size // 2, a.size + 1, 7, round(0.8 * sum(worth[: a.size])), worth[: a.size]
        ),
    )
    assert chosen[-12:].count(Arm("draft", 32)) >= 11, chosen
    assert g.model.expected(8, 7) < g.model.expected(16, 7) < g.model.expected(32, 7)
    assert g.model.expected(32, 7) == pytest.approx(0.8 * sum(worth), rel=0.1)
