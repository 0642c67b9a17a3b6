"""Several generations at once (speculative/batch.py `Lockstep`) in this process, on tiny random int4 models: six
prompts of different lengths and token limits through three slots, joining as slots free, one sampled among the
greedy ones, one cancelled halfway and one whose prompt does not fit: every greedy generation's tokens are exactly
its own run alone, the cancelled slot serves the next prompt, and the prompt that does not fit fails alone."""

import pytest
import torch

from common.errors import PromptError
from common.settings import SamplingConfig, TreeConfig
from speculative.batch import Lockstep, run_all
from speculative.drafter import LocalDraft
from speculative.loop import Speculation
from speculative.lookup import TrieDraft
from speculative.slots import LocalBatch
from speculative.verify import LocalTarget

CONTEXT = 160


def _prompts(n: int = 6) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, 300, (k,), generator=g).tolist() for k in (5, 40, 11, 23, 7, 17)[:n]]


def _loop(target, draft, mode="tree", adaptive=True):
    d = LocalDraft(draft) if draft is not None else TrieDraft(6)
    cfg = TreeConfig(mode=mode if mode != "target" else "tree", width=6, adaptive=adaptive)
    return Speculation(LocalTarget(target), d, mode, cfg, SamplingConfig(), CONTEXT)


@pytest.mark.parametrize(
    "mode,draft_model,shared",
    [("tree", "target", True), ("tree", "other", True), ("tree", "other", False), ("tree", None, False)]
    + [("target", None, False), ("chain", "target", True)],
)
def test_each_generation_of_a_batch_is_its_own_run_alone(int4_pair, mode, draft_model, shared):
    """`shared`: the trees grown in shared draft forwards (speculative/draft_batch.py); with a fixed width (no
    governor timing the cycles) each generation drafts exactly the trees it drafts alone."""
    target, other = int4_pair
    draft = {"target": target, "other": other, None: None}[draft_model]  # the target drafting for itself: all taken
    loop = _loop(target, draft, mode, adaptive=draft is None)
    limits = [30, 12, 41, 25, 8, 33]
    alone = [loop.generate(p, n, set()) for p, n in zip(_prompts(), limits)]
    factory = (lambda slot: LocalDraft(draft)) if draft is not None else (lambda slot: TrieDraft(6))
    propose = LocalDraft.propose_many if shared else None
    batch = Lockstep(loop, LocalBatch(target), factory if mode != "target" else (lambda slot: None), 3, propose)
    jobs = ((i, dict(prompt_ids=p, max_new=n, stop=set())) for i, (p, n) in enumerate(zip(_prompts(), limits)))
    got, most = {}, 0
    for key, o in run_all(batch, jobs):
        assert not isinstance(o, BaseException), o
        most = max(most, batch.active)
        if o.result is not None:
            got[key] = o.result
    assert most == 3  # three at once, the others joining as slots freed
    assert {k: g.new_ids for k, g in got.items()} == {i: a.new_ids for i, a in enumerate(alone)}
    if draft is not None:
        for i, a in enumerate(alone):  # the same trees, drafted and taken
            assert [got[i].stats[k] for k in ("drafted", "accepted", "draft_forwards")] == [
                a.stats[k] for k in ("drafted", "accepted", "draft_forwards")
            ], i
    if draft_model == "target":
        assert sum(g.stats["accepted"] for g in got.values()) > 0  # trees were taken, not just roots


def test_sampled_generations_grow_their_trees_in_shared_forwards_and_each_is_its_run_alone(int4_pair, monkeypatch):
    """Sampled trees grow in draft forwards shared with the other generations' (speculative/draft_batch.py): each
    sampled generation (its own temperature and seed) draws exactly the tokens it draws alone, which are the
    target's alone with that seed (models/sampling.py: a position's draw depends on the seed and the position), while
    the batch ran fewer draft forwards than its trees did."""
    import speculative.draft_batch as draft_batch

    target, draft = int4_pair
    loop = _loop(target, draft, adaptive=False)
    settings = [SamplingConfig(temperature=t, seed=s) for t, s in ((0.8, 3), (1.0, 4), (0.6, 5))]
    prompts = _prompts(3)
    alone = [loop.generate(p, 20, set(), sampling=c) for p, c in zip(prompts, settings)]
    plain = [loop.generate(p, 20, set(), mode="target", sampling=c) for p, c in zip(prompts, settings)]
    assert [a.new_ids for a in alone] == [t.new_ids for t in plain]
    forwards = []
    shared = draft_batch.forward_many_steps
    monkeypatch.setattr(
        draft_batch, "forward_many_steps", lambda m, rows, **k: forwards.append(1) or shared(m, rows, **k)
    )
    batch = Lockstep(loop, LocalBatch(target), lambda slot: LocalDraft(draft), 3, LocalDraft.propose_many)
    for i, (p, c) in enumerate(zip(prompts, settings)):
        batch.join(i, p, 20, set(), sampling=c)
    got = {k: o.result for k, o in run_all(batch, iter(())) if o.result is not None}
    assert {k: g.new_ids for k, g in got.items()} == {i: a.new_ids for i, a in enumerate(alone)}
    trees = sum(g.stats["draft_forwards"] for g in got.values())
    assert trees == sum(a.stats["draft_forwards"] for a in alone) and 0 < len(forwards) < trees


def test_a_batch_takes_joins_cancellations_sampling_and_a_prompt_that_does_not_fit(int4_pair):
    target, draft = int4_pair
    loop = _loop(target, draft)
    prompts = _prompts()
    alone = {i: loop.generate(p, 24, set()).new_ids for i, p in enumerate(prompts)}
    batch = Lockstep(loop, LocalBatch(target), lambda slot: LocalDraft(draft), 3, LocalDraft.propose_many)
    batch.join(0, prompts[0], 24, set())
    batch.join("sampled", prompts[1], 24, set(), sampling=SamplingConfig(temperature=0.8, seed=3))
    batch.join("cancelled", prompts[2], 24, set())
    got, errors, cycles = {}, {}, 0
    while batch.active:
        cycles += 1
        for key, o in batch.cycle():
            if isinstance(o, BaseException):
                errors[key] = o
            elif o.result is not None:
                got[key] = o.result
        if cycles == 3:  # a client went away: its slot takes the next prompt at once
            batch.leave("cancelled")
            assert batch.free == 1
            batch.join(3, prompts[3], 24, set())
            with pytest.raises(Exception, match="already in the batch"):
                batch.join(3, prompts[3], 24, set())
        if cycles == 4:
            assert batch.free == 0
            with pytest.raises(Exception, match="slots are taken"):
                batch.join(9, prompts[4], 24, set())
        if 0 in got and "too long" not in errors and "too long" not in batch.gens:
            batch.join("too long", list(range(3, 3 + CONTEXT)), 24, set())
            batch.join(5, prompts[5], 24, set())
    assert isinstance(errors.pop("too long"), PromptError) and not errors
    assert "cancelled" not in got and len(got["sampled"].new_ids) == 24
    for i in (0, 3, 5):
        assert got[i].new_ids == alone[i], i


def test_a_generation_that_ends_frees_its_slot_with_the_forward_that_ended_it(int4_pair):
    """A generation takes its answer as the forward ends: its tokens go out with that cycle, and the one whose last
    tokens it was leaves at once, so the next job joins its slot before the next forward. Through one slot, every
    cycle is a forward: no cycle only takes answers while the slot stands empty."""
    target, draft = int4_pair
    loop = _loop(target, draft)
    prompts = _prompts(4)
    alone = {i: loop.generate(p, 10, set()).new_ids for i, p in enumerate(prompts)}
    local = LocalBatch(target)
    forwards = []
    answer = local.answer
    local.answer = lambda calls: forwards.append(len(calls)) or answer(calls)
    batch = Lockstep(loop, local, lambda slot: LocalDraft(draft), 1, LocalDraft.propose_many)
    jobs, got, cycles = list(enumerate(prompts)), {}, 0
    while jobs or batch.active:
        if batch.free and jobs:
            key, prompt = jobs.pop(0)
            batch.join(key, prompt, 10, set())
        cycles += 1
        for key, o in batch.cycle():
            got.setdefault(key, []).extend(o.tokens)
            if o.result is not None:
                assert batch.free == 1  # it left with the forward that made its last tokens
    assert got == alone
    assert cycles == len(forwards) and set(forwards) == {1}


def test_a_long_prompt_prefills_a_chunk_a_cycle_beside_the_others_trees(int4_pair, monkeypatch):
    """A prompt of more than a prefill chunk (here 32 rows) rides in the batch's forwards a chunk at a time (the
    other generations verify their trees meanwhile), and a later prompt joins only beside its last chunk."""
    import speculative.batch
    import speculative.verify

    chunk = 32
    monkeypatch.setattr(speculative.verify, "PREFILL_CHUNK", chunk)
    monkeypatch.setattr(speculative.batch, "PREFILL_CHUNK", chunk)
    target, _ = int4_pair
    loop = Speculation(LocalTarget(target), LocalDraft(target), "tree", TreeConfig(width=6), SamplingConfig(), CONTEXT)
    g = torch.Generator().manual_seed(11)
    long = torch.randint(3, 300, (chunk + 20,), generator=g).tolist()
    prompts = [_prompts()[0], long, _prompts()[2]]
    alone = [loop.generate(p, 20, set()).new_ids for p in prompts]
    batch = Lockstep(loop, LocalBatch(target), lambda slot: LocalDraft(target), 3, LocalDraft.propose_many)
    got, first_cycle = {}, {}
    for i, p in enumerate(prompts):
        batch.join(i, p, 20, set())
    cycle = 0
    while batch.active:
        cycle += 1
        for key, o in batch.cycle():
            first_cycle.setdefault(key, cycle)
            if o.result is not None:
                got[key] = o.result.new_ids
    assert got == dict(enumerate(alone))
    # a prompt's first token comes out with the cycle of its last chunk: the short ones fill the first cycle's
    # chunk together, the long one waits for room, then prefills in cycles 2 and 3
    assert first_cycle == {0: 1, 2: 1, 1: 3}


def test_a_resident_batch_steps_several_plainly_and_lets_one_alone_run_as_alone(int4_pair):
    """Resident, rows cost compute: several generations at once begin with plain steps (their single rows in one
    forward cost little more than one; drafting is tried only where the drafts' catch-up on the prompts and the
    plain steps' tokens is a small share of the time since: `CatchUp`), while a generation alone in the batch
    drafts from its first cycle, its own governor choosing as when it runs alone."""
    target, draft = int4_pair
    loop = _loop(target, draft)
    prompts = _prompts(3)
    batch = Lockstep(loop, LocalBatch(target), lambda slot: LocalDraft(draft), 3, LocalDraft.propose_many)
    for i, p in enumerate(prompts):
        batch.join(i, p, 8, set())
    got = {k: o.result for k, o in run_all(batch, iter(())) if o.result is not None}
    assert {k: r.stats["arm_hist"] for k, r in got.items()} == {i: {"plain": 7} for i in range(3)}
    assert set(batch.by_count) == {3}
    batch.join("alone", prompts[0], 8, set())
    (alone,) = [o.result for _, o in run_all(batch, iter(())) if o.result is not None]
    assert any(arm.startswith("draft") for arm in alone.stats["arm_hist"]), alone.stats["arm_hist"]
    assert alone.new_ids == loop.generate(prompts[0], 8, set()).new_ids


def test_conversations_interleaved_over_the_slots_each_find_their_prefix(int4_pair):
    """Two conversations take turns over two slots: each next turn goes to the slot whose cache holds its
    conversation (not the lowest free one, which the other conversation's last turn took), and prefills only its
    new tokens; every answer is the one a run with no cache gives."""
    target, draft = int4_pair
    loop = _loop(target, draft, adaptive=False)
    batch = Lockstep(loop, LocalBatch(target), lambda slot: LocalDraft(draft), 2, LocalDraft.propose_many)
    a, b = _prompts(2)
    texts, slots = {"a": a, "b": b}, {}
    for turn in range(3):
        for name in ("a", "b"):
            key = (name, turn)
            job = (key, dict(prompt_ids=texts[name], max_new=8, stop=set()))
            [g] = [o.result for _, o in run_all(batch, iter([job])) if o.result is not None]
            g_slot = next(s for s, t in batch.texts.kept.items() if t == texts[name] + g.new_ids)
            fresh = loop.generate(texts[name], 8, set(), reuse=False)
            assert g.new_ids == fresh.new_ids, key
            if turn:
                assert g.stats["reused_prompt_tokens"] == len(texts[name]) - 1 - 5, key  # all but this turn's words
                assert slots[name] == g_slot, key  # the slot that held its conversation
            slots[name] = g_slot
            texts[name] = texts[name] + g.new_ids + [7, 8, 9, 10, 11]  # the next turn: the answer and new words
    assert slots["a"] != slots["b"]
