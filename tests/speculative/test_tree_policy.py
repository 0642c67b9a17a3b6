"""The pure parts of tree speculation on hand-made trees: paths, pacer, alpha, trie."""

import pytest

from speculative.governor import CATCH_UP, TRY_SHARE, CatchUp, Cycle, Governor
from speculative.sides import Proposal, Start, Step, Verify
from common.settings import LOOKUP, PLAIN, Arm, arms
from speculative.policy import AdaptiveThreshold, branch_candidates, pace
from speculative.tree import ROOT, TokenTree, Tree, best_branch, longest_accepted_path
from speculative.trie import TokenTrie


def _tree():
    #        root(9)
    #       /       \
    #     a=1 .6    b=2 .3
    #     /   \        \
    #   c=3 .5  d=4 .3  e=5 .9
    #    |
    #   f=6 .8
    t = TokenTree(9)
    a = t.add(1, ROOT, 0.6)
    b = t.add(2, ROOT, 0.3)
    c = t.add(3, a, 0.5)
    t.add(4, a, 0.3)
    t.add(5, b, 0.9)
    t.add(6, c, 0.8)
    return t


def test_flatten_gives_rows_parents_and_depths():
    tokens, parents, depths = _tree().flatten()
    assert tokens == [9, 1, 2, 3, 4, 5, 6]
    assert parents == [-1, 0, 0, 1, 1, 2, 3]
    assert depths == [0, 1, 1, 2, 2, 2, 3]


def test_cumulative_confidence_and_tc():
    t = _tree()
    assert t.nodes[5].cum == pytest.approx(0.6 * 0.5 * 0.8)
    assert t.tree_confidence() == pytest.approx(0.27)  # leaves f 0.24, d 0.18, e 0.27


def test_longest_accepted_path_follows_the_targets_choices():
    t = _tree()
    # the target wants 1, then 3, then 6, then 7 (not in the tree)
    want = {0: 1, 1: 3, 3: 6, 6: 7}
    path, nxt = longest_accepted_path(t, lambda row: want[row])
    assert path == [0, 2, 5] and nxt == 7
    path, nxt = longest_accepted_path(t, lambda row: {0: 2, 2: 8}[row])
    assert path == [1] and nxt == 8  # took b, then e (5) was wrong: 8 is the correction
    path, nxt = longest_accepted_path(t, lambda row: 42)
    assert path == [] and nxt == 42


def test_best_branch_counts_the_most_confident_branch_through_the_accepted_path():
    t = _tree()
    assert best_branch(t, [0, 2, 5]) == (3, 3)  # all of a-c-f correct
    assert best_branch(t, [0]) == (3, 1)  # under a, the most confident leaf is f (0.24 against d 0.18)
    assert best_branch(t, []) == (2, 0)  # nothing accepted: the most confident branch is b-e (0.27)


def test_pacer_grows_the_branch_furthest_below_its_confidence_share():
    t = TokenTree(0)
    hi = t.add(1, ROOT, 0.7)
    lo = t.add(2, ROOT, 0.3)
    assert pace(t, [hi, lo]) == hi  # equal depths: the confident branch deserves more
    deep = t.add(3, hi, 0.9)
    deeper = t.add(4, deep, 0.9)
    t.nodes[hi].fed = t.nodes[deep].fed = True
    # hi's branch has 3 tokens for a share of 5 * 0.567 / (0.567 + 0.3) = 3.27; lo has 1 for 1.73
    assert pace(t, [deeper, lo]) == lo


def test_alpha_halves_when_all_correct_and_rises_by_the_missed_share():
    a = AdaptiveThreshold(alpha=0.01)
    assert a.update(tc=0.2, n_all=4, n_correct=4) == pytest.approx(0.005)
    got = a.update(tc=0.25, n_all=4, n_correct=2)
    assert got == pytest.approx(0.005 / 0.25**0.5)
    assert a.should_verify(0.005) and not a.should_verify(0.5)
    for _ in range(50):
        a.update(tc=1e-9, n_all=1, n_correct=0)
    assert a.alpha == a.ceiling


def test_branch_candidates_keep_the_top_and_those_over_the_threshold():
    probs = [(7, 0.5), (8, 0.31), (9, 0.29), (10, 0.01)]
    assert branch_candidates(probs, 0.3, 8) == [(7, 0.5), (8, 0.31)]
    assert branch_candidates([(7, 0.2), (8, 0.1)], 0.3, 8) == [(7, 0.2)]
    assert branch_candidates(probs, 0.3, 1) == [(7, 0.5)]


def test_trie_retrieves_the_most_frequent_continuations_of_the_longest_match():
    trie = TokenTrie(branch_len=5)
    trie.insert([1, 2, 3, 4, 1, 2, 3, 5, 9, 2, 3, 4])
    d = trie.retrieve([7, 1, 2, 3], max_nodes=4)
    assert d.prefix_len == 3 and d.tokens[:2] == [4, 5] and d.parents[:2] == [-1, -1]
    assert d.probs[0] == pytest.approx(0.5)
    assert trie.retrieve([6, 6], max_nodes=4).tokens == []  # nothing matches


def test_trie_stays_under_capacity():
    trie = TokenTrie(branch_len=4, capacity=50)
    trie.insert(list(range(200)))
    assert trie.size <= 50


D2, D4 = Arm("draft", 2), Arm("draft", 4)


def test_governor_prefers_what_measured_faster_and_keeps_probing():
    g = Governor(arms=(PLAIN, D2, D4), start=D4, explore_every=3)
    chosen = []
    for _ in range(30):
        w = g.choose()
        chosen.append(w)
        g.record(
            w, tokens={PLAIN: 1, D2: 2, D4: 5}[w], seconds={PLAIN: 0.1, D2: 0.15, D4: 0.3}[w]
        )  # 10, 13.3, 16.7 tok/s
    assert chosen[0] == D4 and PLAIN in chosen[:3]  # starts with its guess, measures the plain step early
    assert chosen[-6:].count(D4) >= 4


def test_governor_backs_off_probing_what_keeps_losing():
    """The plain step wins (10 tok/s against 5): tries of budget 2 grow rarer, up to max_gap."""
    g = Governor(arms=(PLAIN, D2), start=D2, explore_every=3, max_gap=24)
    chosen = []
    for _ in range(200):
        w = g.choose()
        chosen.append(w)
        g.record(w, tokens=1, seconds={PLAIN: 0.1, D2: 0.2}[w])
    tries = [i for i, w in enumerate(chosen) if w == D2]
    gaps = [b - a for a, b in zip(tries, tries[1:])]
    assert gaps == sorted(gaps) and gaps[-1] == 24 and len(tries) < 15, tries
    # the text turns: budget 2 now pays twice the plain step; one try finds it, the tries come
    # back to every 3 cycles until the averages turn, then the plain step is the one tried rarely
    later = []
    for _ in range(60):
        w = g.choose()
        later.append(w)
        g.record(w, tokens={PLAIN: 1, D2: 4}[w], seconds={PLAIN: 0.1, D2: 0.2}[w])
    first = later.index(D2)
    assert first <= 24 and later[first + 1 : first + 8].count(D2) >= 2
    assert later[-20:].count(D2) >= 19 and g.gap > g.explore_every


def test_a_try_that_costs_many_cycles_waits_until_its_loss_is_a_small_share():
    """A resident batch's governor (`try_share`): plain cycles of 0.03 s make 4 tokens; a try of budget 2 costs
    0.3 s for 8 (the drafts' catch-up). The next try waits until what it lost, 0.24 s, is 3% of the cycles since:
    267 cycles, not max_gap's 24; a try that wins brings the tries back to every 3 cycles."""
    g = Governor(arms=(PLAIN, D2), start=PLAIN, explore_every=3, max_gap=24, try_share=0.03)
    chosen = []
    for _ in range(600):
        w = g.choose()
        chosen.append(w)
        g.record(w, tokens={PLAIN: 4, D2: 8}[w], seconds={PLAIN: 0.03, D2: 0.3}[w])
    tries = [i for i, w in enumerate(chosen) if w == D2]
    assert len(tries) == 3 and tries[0] < 6 and all(b - a >= 267 for a, b in zip(tries, tries[1:])), tries
    g.record(D2, tokens=200, seconds=0.3)  # not a try: no gap change
    assert g.gap >= 267
    g.trying = D2
    g.record(D2, tokens=400, seconds=0.3)  # a try that wins
    assert g.gap == 3


def test_a_try_is_judged_without_the_drafts_catch_up_and_a_lost_one_counts_it():
    """A try of drafting after plain steps first pays the drafts' catch-up on the text they missed, which drafting
    on would not pay again: its rate leaves that out (here 8 tokens in 0.05 s of its own, beating plain's 4 in
    0.03 s), while a try that loses counts all it cost in the wait before the next."""
    g = Governor(arms=(PLAIN, D2), start=PLAIN, explore_every=3, max_gap=24, try_share=0.03)
    while g.choose() == PLAIN:
        g.record(PLAIN, tokens=4, seconds=0.03)
    g.record(D2, tokens=8, seconds=0.3, catchup_s=0.25)
    assert g.rate[D2] > g.rate[PLAIN] and g.gap == 3 and g.choose() == D2
    lost = Governor(arms=(PLAIN, D2), start=PLAIN, explore_every=3, max_gap=24, try_share=0.03)
    while lost.choose() == PLAIN:
        lost.record(PLAIN, tokens=4, seconds=0.03)
    lost.record(D2, tokens=4, seconds=0.3, catchup_s=0.25)  # 4 tokens in 0.05 s of its own: it lost
    assert lost.gap >= (0.3 - 0.03) / (0.03 * 0.03)  # the whole 0.3 s it took, not its own 0.05 s


START, STEP = Start([], 0, None, True), Step(0)


def _verify(drafted: bool) -> Verify:
    return Verify(Proposal(Tree(0, [1], [-1], [0.9]), drafted))


def test_a_resident_batch_tries_drafting_only_while_its_drafts_catch_up_is_a_small_share():
    """`CatchUp`: a try of drafting first runs the drafts over what they have not seen (a new generation's prompt,
    then a token per plain step, at most CATCH_UP once it drafted). Priced before the try, it is made only while
    that costs at most TRY_SHARE of the seconds since the last; a row priced as the target's prompt rows cost until
    a catch-up measured one."""
    c = CatchUp()
    c.join("a", 40, [])
    c.join("b", 60, ["a"])
    assert c.price(["a", "b"]) is None and not c.may_try(["a", "b"])  # nothing priced a row yet
    c.answered([("a", START, 40), ("b", START, 60)], 0.2)  # 100 prompt rows in 0.2 s
    assert c.price(["a", "b"]) == pytest.approx(0.2)
    for _ in range(10):
        c.answered([("a", STEP, 1), ("b", STEP, 1)], 0.03)
        c.spent += 0.03
    assert (c.rows("a"), c.rows("b")) == (50, 70) and c.price(["a", "b"]) == pytest.approx(0.24)
    assert not c.may_try(["a", "b"]) and c.spent == pytest.approx(0.3)  # 0.24 s is 80% of 0.3 s
    c.spent = 0.24 / TRY_SHARE
    assert c.may_try(["a", "b"]) and c.spent == 0.0  # a try: the count starts again
    assert c.drafted([("a", 0.05), ("b", 0.07)]) == pytest.approx(0.12)  # their catch-up: 120 rows
    assert c.row_s == pytest.approx(0.001)
    c.answered([("a", _verify(drafted=True), 4), ("b", _verify(drafted=True), 3)], 0.05)
    assert (c.rows("a"), c.rows("b")) == (1, 1)  # each behind by the target's next token alone
    c.answered([("b", _verify(drafted=False), 3)], 0.03)  # the trie's candidates: b's draft ran on none of them
    assert c.rows("b") == 2
    for _ in range(30):
        c.answered([("a", STEP, 1), ("b", STEP, 1)], 0.03)
    assert c.rows("a") == CATCH_UP and c.price(["a", "b"]) == pytest.approx(2 * CATCH_UP * 0.001)
    c.join("c", 20, ["a"])  # b went: only those who run are priced and kept
    assert set(c.behind) == {"a", "c"}


def test_a_governor_makes_no_try_of_drafting_that_may_try_refuses():
    """A resident batch's governor asks `may_try` before each try of drafting, never before playing what leads."""
    asked = []
    g = Governor(arms=(PLAIN, D2), start=PLAIN, explore_every=3, max_gap=24, try_share=0.03)
    g.may_try = lambda: asked.append(g.cycles) or len(asked) > 5
    chosen = []
    for _ in range(30):
        w = g.choose()
        chosen.append(w)
        g.record(w, tokens={PLAIN: 4, D2: 12}[w], seconds=0.03)
    first = chosen.index(D2)
    assert len(asked) == 6 and D2 not in chosen[:first]  # refused five times, then tried
    assert (
        chosen[first:].count(D2) >= 2 * len(chosen[first:]) // 3 and PLAIN in chosen[first:]
    )  # drafting won: it leads, and the tries of plain steps ask nothing
    assert len(asked) == 6


def test_arca_acceptance_table_counts_ranks_along_correct_chains():
    from speculative.arca import acceptance_table

    # one sequence: top-1, top-1, rank 2, top-1, miss
    acc = acceptance_table([[0, 0, 2, 0, 4]], max_depth=3, k=4)
    # depth 1: every position tried: ranks 0,0,2,0,4 -> acc[0] = [3/5, 0, 1/5, 0]
    assert acc[0] == pytest.approx([0.6, 0.0, 0.2, 0.0])
    # depth 2: chains starting where depth 1 was top-1 (t = 0, 1, 3): next ranks 0, 2, 4
    assert acc[1] == pytest.approx([1 / 3, 0.0, 1 / 3, 0.0])


def test_arca_tree_adds_the_likeliest_node_each_time_and_choice_prefers_throughput():
    from speculative.arca import build_tree, choose

    acc = [[0.8, 0.1, 0.05, 0.0]] * 8
    shape = build_tree(acc, 3)
    assert shape.parents == (-1, 0, 1) and shape.ranks == (0, 0, 0)  # 0.8 > 0.64 > 0.512 > 0.1
    assert shape.expected == pytest.approx(0.8 + 0.64 + 0.512)
    wide = build_tree(acc, 8)
    assert (-1, 1) in set(zip(wide.parents, wide.ranks)) or len(wide.parents) == 8
    # verification free up to 9 rows, then costly: the best width is within that range
    verify = {(r, "none"): (0.1 if r <= 9 else 0.1 * r / 9) for r in (2, 3, 5, 9, 17, 33, 65)}
    rows = choose(acc, step_s=0.1, verify_s=verify, draft_level_s={1: 0.01, 2: 0.012, 4: 0.015, 8: 0.02})
    assert rows[0]["width"] in (4, 8) and rows[0]["tokens_per_s"] > 1 / 0.1
    slow = choose(acc, step_s=0.1, verify_s={k: 1.0 for k in verify}, draft_level_s={1: 0.5})
    assert slow[0]["width"] == 0  # nothing pays: the target alone


def test_governor_ignores_budgets_cut_short_by_the_end():
    """A run kept across prompts records cycles whose draft the end of a generation clipped
    (3 of 4 tokens left): they are not one of its arms and must not become its choice."""
    g = Governor(arms=(PLAIN, D2, D4), start=D4)
    g.record(Arm("draft", 3), tokens=4, seconds=0.01)  # very fast, but no arm of its own
    for _ in range(20):
        w = g.choose()
        assert w in (PLAIN, D2, D4)
        g.record(w, tokens=1 + w.size // 2, seconds=0.1)


def test_a_draft_far_behind_catches_up_on_the_recent_tokens_only():
    """After plain target steps the draft runs on the last CATCH_UP tokens it missed, not all of them
    (the prompt itself it always runs whole), and drafts on from there."""
    from common.settings import SamplingConfig
    from models.transformer import Transformer
    from formats.weights import TensorWeights, random_tensors
    from speculative.drafter import Drafter
    from common.settings import CATCH_UP, TreeConfig
    from tests.conftest import TINY

    args = TINY["qwen"]
    model = Transformer(args, TensorWeights(args, random_tensors(args, 3), "fp32"))
    d = Drafter(model, SamplingConfig(), TreeConfig(mode="chain", chain_k=2, trie=False))
    prompt = [5, 9, 2, 7, 3, 11, 4, 8, 6, 10, 12, 13]
    d.start(prompt, 128)
    d.push([14])
    d.advance(None, [], [])  # nothing verified: the draft has not run yet
    tree = d.build_tree()
    assert d.cache.length == len(prompt) + 1 and d.skipped == 0 and len(tree.tree) == 2
    d.advance(None, [], [15])  # the governor chose plain steps for a while
    for tok in range(16, 16 + 3 * CATCH_UP):
        d.advance(None, [], [tok])
    behind = len(d.pending)
    tree = d.build_tree()
    assert d.skipped == behind - CATCH_UP and d.cache.length == len(prompt) + 1 + CATCH_UP
    assert tree.tree.root_token == 15 + 3 * CATCH_UP and len(tree.tree) == 2
    assert d.context[-1] == tree.tree.root_token  # the trie's view keeps every token


def test_prompt_lookup_proposes_the_tries_continuation_without_a_draft_forward():
    """The LOOKUP arm: the trie's continuation of the text's last n-gram, verified as a tree, with the
    draft model never run (its cache stays as it was; the verdict is taken like a plain step's)."""
    from common.settings import SamplingConfig
    from models.transformer import Transformer
    from formats.weights import TensorWeights, random_tensors
    from speculative.drafter import Drafter
    from common.settings import TreeConfig
    from tests.conftest import TINY

    assert arms(TreeConfig())[0] == LOOKUP and LOOKUP < PLAIN < D2  # the lookup arm is the plain step's neighbour
    assert LOOKUP not in arms(TreeConfig(trie=False)) and LOOKUP not in arms(TreeConfig(mode="chain"))
    assert arms(TreeConfig(), draft_model=False) == (LOOKUP, PLAIN)
    args = TINY["qwen"]
    d = Drafter(Transformer(args, TensorWeights(args, random_tensors(args, 3), "fp32")), SamplingConfig(), TreeConfig())
    prompt = [5, 9, 2, 7, 3, 11, 4, 8, 6, 5, 9]
    d.start(prompt, 64)
    d.push([2])  # the text now ends with "5 9 2", seen before followed by "7 3 11 4 8"
    t = d.lookup(4)
    assert t.forwards == 0 and t.trie_nodes == 4 and t.tree.root_token == 2
    assert [n.token for n in t.tree.nodes] == [7, 3, 11, 4] and [n.parent for n in t.tree.nodes] == [-1, 0, 1, 2]
    assert d.cache.length == 0 and d.pending == prompt + [2]  # the draft ran on nothing
    d.advance(None, [0, 1], [7, 3, 6])  # the target took "7 3", then said 6
    assert d.pending == prompt + [2, 7, 3, 6] and d.context[-4:] == [2, 7, 3, 6]
    assert d.lookup(4) is None  # "3 6" was never seen: nothing to propose, a plain step instead


def test_a_new_text_is_probed_again_soon_with_what_was_learned_kept():
    g = Governor(arms=(LOOKUP, PLAIN, D2), start=D2, explore_every=3, max_gap=24)
    for _ in range(120):  # a draft of 2 and the lookup lose on this text: tries back off to every 24 cycles
        w = g.choose()
        g.record(w, tokens=1, seconds={LOOKUP: 0.15, PLAIN: 0.1, D2: 0.2}[w])
    assert g.gap == 24
    rates = dict(g.rate)
    g.new_text()
    chosen = [g.choose() for _ in range(4)]
    assert chosen[:2] == [PLAIN, PLAIN] and chosen[2] in (LOOKUP, D2) and g.rate == rates


def test_the_draft_runs_on_the_prompts_last_window_only():
    """`prompt_window`: the draft's prefill covers the prompt's last tokens, positions from 0; the
    trie still holds the whole prompt, and a window of 0 feeds it all."""
    from common.settings import SamplingConfig
    from models.transformer import Transformer
    from formats.weights import TensorWeights, random_tensors
    from speculative.drafter import Drafter
    from common.settings import TreeConfig
    from tests.conftest import TINY

    args = TINY["qwen"]
    model = Transformer(args, TensorWeights(args, random_tensors(args, 3), "fp32"))
    prompt = [5, 9, 2, 7, 3, 11, 4, 8, 6, 10, 12, 13]
    for window, fed in ((5, 5), (0, len(prompt)), (64, len(prompt))):
        d = Drafter(model, SamplingConfig(), TreeConfig(mode="chain", chain_k=2, trie=True, prompt_window=window))
        d.start(prompt, 128)
        d.push([14])
        tree = d.build_tree()
        assert d.cache.length == fed + 1 and d.skipped == len(prompt) - fed, window
        assert d.context == prompt + [14] and len(tree.tree) >= 2
    # the window's draft is the same model on the same last tokens: its first guess equals a fresh
    # draft's on just those tokens
    a = Drafter(model, SamplingConfig(), TreeConfig(mode="chain", chain_k=2, trie=False, prompt_window=5))
    b = Drafter(model, SamplingConfig(), TreeConfig(mode="chain", chain_k=2, trie=False, prompt_window=0))
    a.start(prompt, 128), b.start(prompt[-5:], 128)
    a.push([14]), b.push([14])
    assert a.build_tree().tree.flatten()[0] == b.build_tree().tree.flatten()[0]
    from common.errors import CadenceError

    with pytest.raises(CadenceError, match="prompt window"):
        TreeConfig(prompt_window=-1)


def _draft_cycle(n: int, accepted: int, forward_s: float = 0.009, verify_s: float = 0.025):
    """A chain of n draft tokens, `accepted` of them right, at these costs (a speculative.governor.Cycle)."""
    from speculative.governor import Cycle

    return Cycle(n * forward_s, verify_s, n, n + 1, n, accepted)


def play(g, rounds: int, plain_s: float, cycle) -> list[Arm]:
    """`rounds` cycles of governor `g`: a plain step takes `plain_s`, a draft arm `a` what `cycle(a)` measured."""
    chosen = []
    for _ in range(rounds):
        a = g.choose()
        chosen.append(a)
        if a == PLAIN:
            g.record(a, 1, plain_s)
        else:
            c = cycle(a)
            g.record(a, c.accepted + 1, c.draft_s + c.verify_s, c)
    return chosen


def test_the_governor_prices_every_budget_from_one_measured_acceptance():
    """Chains of 6 that are accepted whole: the model says the deepest budget earns most and plays it, without
    stepping through the budgets a neighbour at a time; when the draft's tokens start failing at once, it falls
    back to the plain step (measured at 22 ms a token)."""
    from speculative.governor import Governor

    sizes = tuple(Arm("draft", n) for n in range(1, 7))
    g = Governor(arms=(PLAIN, *sizes), start=Arm("draft", 2))
    chosen = play(g, 20, 0.022, lambda a: _draft_cycle(a.size, a.size))
    assert chosen[:2] == [Arm("draft", 2), PLAIN] and chosen[2].size > 2, chosen  # a jump, not a neighbour
    assert chosen[-10:].count(Arm("draft", 6)) >= 9 and g.model.p > 0.95
    late = play(g, 30, 0.022, lambda a: _draft_cycle(a.size, 0))  # prose: the first draft token is wrong every time
    assert late[-10:].count(PLAIN) >= 9 and g.model.p < 0.6, late


def test_one_stalled_cycle_does_not_price_drafting_out():
    """A draft forward that took 10x its usual time (a neighbour on the shared host) moves the average as a
    forward 1.5x its usual would: the governor keeps drafting."""
    from speculative.governor import Governor

    d4 = Arm("draft", 4)
    g = Governor(arms=(PLAIN, d4), start=d4)
    g.record(PLAIN, 1, 0.022)
    for _ in range(5):
        c = _draft_cycle(4, 4)
        g.record(d4, 5, c.draft_s + c.verify_s, c)
    c = _draft_cycle(4, 4, forward_s=0.09)
    g.record(d4, 5, c.draft_s + c.verify_s, c)
    assert g.model.forward_s < 0.009 * 1.2 and g.estimate(d4) > g.estimate(PLAIN)
    assert g.choose() == d4


def test_a_first_tree_that_missed_does_not_price_drafting_out():
    """Under the wall a forward costs the disk's 0.7 s whatever its rows. A best-first tree of 16 nodes is a chain
    of 8 the draft believes (each node's path 0.9^k) and 8 side branches it doubts; the first tree has its first
    token wrong, the trees after it are accepted as their worths say. One miss once priced every budget at nothing
    for good (the average of what was accepted started at 0, and a sample above an average of 0 never moved it)
    and the governor stepped plainly, a token a forward: it plays the widest tree again at once, and keeps it."""
    from speculative.governor import CostModel

    sizes = (2, 4, 8, 16)
    worth = sorted([0.9**k for k in range(1, 9)] + [0.08 * 0.9**k for k in range(1, 9)], reverse=True)

    def cycle(n: int, accepted: int) -> Cycle:
        return Cycle(0.01 * n / 2, 0.7, n // 2, n + 1, min(n, 8), accepted, tuple(worth[:n]))

    g = Governor((PLAIN, *(Arm("draft", n) for n in sizes)), Arm("draft", 16), model=CostModel(worth_priced=True))
    assert g.choose() == Arm("draft", 16)
    g.record(Arm("draft", 16), 1, 0.78, cycle(16, 0))
    chosen = play(g, 24, 0.7, lambda a: cycle(a.size, min(a.size, 8, round(sum(worth[: a.size])))))
    assert chosen[0] == PLAIN and chosen[1] == Arm("draft", 16), chosen  # the bar measured, then the tree again
    assert sum(a.size >= 8 for a in chosen[-12:] if a.kind == "draft") >= 10, chosen
    assert g.model.expected(16, 8) <= 16


def test_under_the_wall_a_generation_plays_trees_only():
    """Where the target streams, a forward is one read whatever its rows, and a tree (the trie's candidates in it)
    earns at least what a plain step or the trie alone would for that read: a generation's governor there chooses
    among tree sizes only, and never tries another size once one measured cycle priced them all. Resident, the
    plain step and lookup stay arms."""
    from types import SimpleNamespace

    from common.modes import Mode
    from common.settings import TreeConfig
    from speculative.loop import Speculation

    run, draft, cfg = SimpleNamespace(governors={}, target=None), SimpleNamespace(has_model=True), TreeConfig(width=16)
    streamed, resident = SimpleNamespace(streamed=True), SimpleNamespace(streamed=False)
    g = Speculation._governor(run, Mode.TREE, cfg, draft, {}, streamed)
    assert g.arms and all(a.kind == "draft" for a in g.arms) and not g.plain
    worth = tuple(0.9**k for k in range(1, 9))
    chosen = play(
        g, 30, 0.7, lambda a: Cycle(0.01 * a.size, 0.7, a.size, a.size + 1, min(a.size, 8), 5, worth[: a.size])
    )
    assert all(a.kind == "draft" for a in chosen) and len(set(chosen[10:])) == 1, chosen  # no tries
    assert {LOOKUP, PLAIN} <= set(Speculation._governor(run, Mode.TREE, cfg, draft, {}, resident).arms)


def test_the_cost_model_interpolates_verification_by_rows():
    from speculative.governor import CostModel

    m = CostModel(plain_s=0.02, verify_s={5: 0.025, 9: 0.033})
    assert m.verification(1) == 0.02 and m.verification(7) == pytest.approx(0.029)
    assert m.verification(13) == pytest.approx(0.041)  # past the widest: the last slope
    assert CostModel().rate(Arm("draft", 4)) is None  # nothing measured: no estimate


def test_a_trees_depth():
    from speculative.tree import Tree

    assert Tree(9, [1, 2, 3, 4], [-1, -1, 0, 2], [0.5] * 4).depth == 3
    assert Tree(9, [], [], []).depth == 0
