"""Several generations' trees verified in one forward (models/batch.py, speculative/verify.py `verify_many`):
every family's block, int4 on the CPU kernels; three generations of different prompts and lengths, each drafting
with its own draft (the target itself, or another model of its shape), go through eight cycles in lockstep, and each one's verdicts, committed tokens and cache are
those it gets verified alone (where the one-call layer kernel runs its layers)."""

import pytest
import torch

from common.settings import SamplingConfig, TreeConfig
from formats import loading
from formats.convert import convert
from formats.source_hf import HFSource
from formats.store import WeightStore
from speculative.drafter import LocalDraft
from speculative.generate import generate_speculative, generate_target
from speculative.tree import TokenTree
from speculative.verify import Verifier, verify_many
from tests.models.families import tiny_hf
from tests.scheduler.test_families_streamed import FAMILIES

CYCLES = 8


def _stores(tmp_path, mt, v, wide_heads: bool = False):
    """The target, and a draft of the same shape that agrees with it only in part (other weights)."""
    out = []
    for name, seed in (("target", 1), ("draft", 2)):
        hf = tiny_hf(mt, v, tmp_path / f"hf-{name}", seed=seed, wide_heads=wide_heads)
        out.append(WeightStore(convert(HFSource(hf), tmp_path / f"int4-{name}", "int4")))
    return out


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in (5, 19, 11)]


class _Generation:
    """One generation as a loop runs it: its verifier (its own KV cache) and its draft."""

    def __init__(self, target, draft_model, prompt: list[int]):
        self.verifier = Verifier(target, SamplingConfig())
        root = self.verifier.start(prompt, 128)
        self.draft = LocalDraft(draft_model)
        self.draft.start(prompt, 128, root, TreeConfig(width=6), SamplingConfig())
        self.verdicts = []

    def propose(self):
        self.p = self.draft.propose(6)
        return TokenTree.of(self.p.tree)

    def take(self, v):
        self.verdicts.append((list(v.path), v.next_token, v.rows))
        self.draft.advance(self.p, list(v.path), [self.p.tokens[i] for i in v.path] + [v.next_token])


@pytest.mark.parametrize("mt,v", FAMILIES)
def test_a_batch_of_trees_gives_each_generation_its_own_verdicts(tmp_path, mt, v):
    _batch_against_alone(tmp_path, mt, v, one_call=True)


@pytest.mark.parametrize("mt,v", [FAMILIES[1], FAMILIES[2]])
def test_a_batch_through_the_separate_calls_gives_the_same_verdicts(tmp_path, mt, v):
    """Where the one-call kernel does not take a layer, the batch runs it through the separate kernel calls."""
    _batch_against_alone(tmp_path, mt, v, one_call=False)


# a family of each kind of cache: a plain one, sliding windows, a convolution's rows, delta-net and Mamba-2 states
# beside attention, keys shared between layers
HALF = [FAMILIES[i] for i in (0, 3, 11, 12, 15, 16)]


@pytest.mark.parametrize("kv", ["f16", "q8"])
@pytest.mark.parametrize("mt,v", HALF)
def test_half_and_q8_caches_give_the_target_alone_at_their_dtype_and_each_generation_its_own_verdicts(
    tmp_path, mt, v, kv
):
    """--kv-dtype f16 and q8 in every cache (the target's and the draft's): a tree writes what the target alone
    writes at that dtype, token for token, and a batch gives each generation its verdicts alone, keys and values to
    the bit."""
    target_store, draft_store = _stores(tmp_path, mt, v, wide_heads=kv == "q8")
    target, draft = loading.load_store(target_store), loading.load_store(draft_store)
    target.model.kv_dtype = draft.model.kv_dtype = kv
    for prompt in _prompts():
        want = generate_target(target, prompt, 24, SamplingConfig(), stop_at_eos=False)
        got = generate_speculative(target, draft, prompt, 24, SamplingConfig(), TreeConfig(width=6), stop_at_eos=False)
        assert got.new_ids == want.new_ids
    _batch_against_alone(tmp_path, mt, v, one_call=True, kv_dtype=kv)


def _batch_against_alone(tmp_path, mt, v, one_call: bool, kv_dtype: str = "f32"):
    """Three generations verified alone (through the one-call layer kernel), and in batches (through
    `cad_layer_many`, or the separate calls): the same verdicts, tokens, keys and values."""
    target_store, draft_store = _stores(tmp_path / "batch", mt, v, wide_heads=kv_dtype == "q8")
    target, draft = loading.load_store(target_store).model, loading.load_store(draft_store).model
    batch_target = loading.load_store(target_store).model
    batch_target.layer_calls = one_call
    for m in (target, draft, batch_target):
        m.kv_dtype = kv_dtype
    drafts = [target, draft, target]  # the target drafting for itself: its trees are taken whole
    alone = [_Generation(target, d, p) for d, p in zip(drafts, _prompts())]
    batched = [_Generation(batch_target, d, p) for d, p in zip(drafts, _prompts())]
    for cycle in range(CYCLES):
        for g in alone:
            g.take(g.verifier.verify_tree(g.propose()))
        trees = [g.propose() for g in batched]
        if cycle % 3 == 2:  # generations join and leave between cycles: here the middle one sits one out
            jobs = [(batched[0], trees[0]), (batched[2], trees[2])]
            batched[1].take(batched[1].verifier.verify_tree(trees[1]))
        else:
            jobs = list(zip(batched, trees))
        for g, verdict in zip([g for g, _ in jobs], verify_many([(g.verifier, t) for g, t in jobs])):
            g.take(verdict)
    assert sum(len(path) for g in alone for path, _, _ in g.verdicts) > CYCLES  # trees were taken, not just roots
    for a, b in zip(alone, batched):
        assert b.verdicts == a.verdicts and b.verifier.tokens == a.verifier.tokens
        n = a.verifier.cache.length
        assert b.verifier.cache.length == n
        for i in range(target.args.n_layers):  # the same keys and values, bit for bit
            ka, va, _ = a.verifier.cache.kv(i)
            kb, vb, _ = b.verifier.cache.kv(i)
            assert torch.equal(ka, kb) and (va is vb is None or torch.equal(va, vb))  # a convolution: rows, None
            keys = a.verifier.cache.index[i][0] in ("full", "sliding")  # (a recurrent layer's rows: float32)
            want = {"f32": torch.float32, "f16": torch.float16, "q8": torch.uint8}[kv_dtype]
            assert ka.dtype == (want if keys else torch.float32)


def test_a_batch_mixes_sampled_and_greedy_generations_but_not_models(tmp_path):
    """A sampled generation's rows need the logits: the batch computes them for all, and the greedy one takes their
    argmax, the token it gets alone. Two target models cannot share a forward."""
    target_store, draft_store = _stores(tmp_path, "qwen2", "sliding")
    target, other = loading.load_store(target_store).model, loading.load_store(draft_store).model
    sampled = Verifier(target, SamplingConfig(temperature=0.7, seed=1))
    sampled.start([5, 6, 7], 32)
    greedy, alone = Verifier(target, SamplingConfig()), Verifier(target, SamplingConfig())
    greedy.start([5, 6, 8], 32)
    alone.start([5, 6, 8], 32)
    tree = TokenTree.of(type("T", (), {"root": 9, "tokens": [4], "parents": [-1], "probs": [1.0]})())
    verdict = verify_many([(greedy, tree), (sampled, tree)])[0]
    assert verdict == alone.verify_tree(tree) and greedy.tokens == alone.tokens
    foreign = Verifier(other, SamplingConfig())
    foreign.start([5, 6, 8], 32)
    from common.errors import CadenceError

    with pytest.raises(CadenceError, match="one target model"):
        verify_many([(greedy, tree), (foreign, tree)])
    assert verify_many([]) == []
