"""The batch's KV pool (speculative/kvpool.py): where each slot's target cache goes in one arena, and what a batch
does with it (speculative/batch.py `Lockstep` with `kv_size`): a prompt longer than a slot's share runs when the
others leave room, waits while they do not, and every greedy generation is still its own run alone."""

import pytest
import torch

from common.errors import PromptError
from common.settings import SamplingConfig, TreeConfig
from speculative.batch import Lockstep, NoRoom, run_all
from speculative.drafter import LocalDraft
from speculative.kvpool import KVPool
from speculative.loop import Speculation
from speculative.slots import LocalBatch
from speculative.verify import LocalTarget
from tests.speculative.test_lockstep import _prompts


def test_the_pool_places_ranges_keeps_a_slots_last_one_and_gives_idle_ones_up():
    pool = KVPool(100, lambda rows: 2 * rows)  # two elements a row: 50 rows in all
    assert pool.most == 50
    a = pool.place(0, 20)
    b = pool.place(1, 10)
    assert (a.offset, a.capacity, a.kept) == (0, 20, False) and b.offset == 40
    assert pool.place(2, 25) is None  # 20 free rows at the end: it waits
    assert pool.place(2, 10).offset == 60
    pool.end(0)
    again = pool.place(0, 15)  # the slot's own last range holds it: kept, its prefix reusable
    assert again == (0, 20, 100, True)
    pool.end(0)
    pool.end(1)
    big = pool.place(3, 30)  # idle ranges go, the widest first, until a gap is wide enough: here both
    assert big == (0, 30, 100, False) and set(pool.ranges) == {2, 3}
    pool.drop(2)
    assert set(pool.ranges) == {3}
    assert pool.place(2, 26) is None  # 40 elements free behind slot 3's live range
    pool.end(3)
    assert pool.place(2, 50) == (0, 50, 100, False) and set(pool.ranges) == {2}


def test_generations_of_at_most_a_share_each_always_find_room():
    """Slots joining and leaving at random with generations of any size up to a share: each slot's home range
    takes them, so the arena never fragments into gaps too narrow for the next (first fit alone would)."""
    pool, rng = KVPool(100, lambda rows: rows, 4), torch.Generator().manual_seed(5)
    live = set()
    for _ in range(400):
        slot = int(torch.randint(0, 4, (1,), generator=rng))
        if slot in live:
            pool.end(slot)
            live.discard(slot)
            continue
        rows = int(torch.randint(1, 26, (1,), generator=rng))
        placed = pool.place(slot, rows)
        assert placed is not None, (slot, rows, pool.ranges)
        live.add(slot)
    taken = sorted((r.offset, r.offset + r.size) for r in pool.ranges.values())
    assert all(a[1] <= b[0] for a, b in zip(taken, taken[1:]))  # no two ranges overlap


def test_a_sliding_window_cache_is_sized_by_its_own_function():
    window = lambda rows: 3 * rows + 2 * min(rows, 8)  # noqa: E731 - full layers grow, sliding ones stop at 8
    pool = KVPool(window(40) * 2, window)
    assert pool.most == (window(40) * 2 - 16) // 3
    assert pool.place(0, 40) is not None and pool.place(1, 40) is not None and pool.place(2, 1) is None


SHARE = 96  # a slot's context: three slots' pool holds 354 rows, a generation at most 248 (the tiny model's 256)


def _pooled(target, draft, context: int = SHARE):
    cfg, most = TreeConfig(width=6), target.args.context_length
    loop = Speculation(LocalTarget(target), LocalDraft(draft), "tree", cfg, SamplingConfig(), context, most)
    kv = lambda rows: target.args.kv_bytes(rows) // 4  # noqa: E731
    return loop, Lockstep(loop, LocalBatch(target), lambda slot: LocalDraft(draft), 3, LocalDraft.propose_many, kv)


def test_a_prompt_longer_than_a_share_waits_for_room_then_runs_as_alone(int4_pair):
    target, draft = int4_pair
    loop, batch = _pooled(target, draft)
    assert batch.most_context() == 248
    g = torch.Generator().manual_seed(3)
    long = torch.randint(3, 300, (180,), generator=g).tolist()  # past a share, within the pool
    prompts = _prompts(3)
    alone = {i: loop.generate(p, None if i < 2 else 16, set()).new_ids for i, p in enumerate(prompts)}
    alone["long"] = _pooled(target, draft, 248)[0].generate(long, 24, set()).new_ids
    # two with no number of tokens (a share each) hold 208 rows; the long one's 212 wait until one of them ends
    jobs = [(0, dict(prompt_ids=prompts[0], max_new=None, stop=set()))]
    jobs += [(1, dict(prompt_ids=prompts[1], max_new=None, stop=set()))]
    jobs += [
        ("long", dict(prompt_ids=long, max_new=24, stop=set())),
        (2, dict(prompt_ids=prompts[2], max_new=16, stop=set())),
    ]
    got, ended_before = {}, None
    for key, o in run_all(batch, iter(jobs)):
        assert not isinstance(o, BaseException), o
        if ended_before is None and "long" in batch.gens:
            ended_before = set(got)
        if o.result is not None:
            got[key] = o.result.new_ids
    assert got == alone
    assert ended_before and ended_before <= {0, 1}  # it joined once one of the two had ended, not before
    assert batch.pool.ranges and all(not r.live for r in batch.pool.ranges.values())


def test_a_prompt_past_the_whole_pool_fails_alone_and_a_full_pool_says_no_room(int4_pair):
    target, draft = int4_pair
    _, batch = _pooled(target, draft)
    batch.join("too long", list(range(3, 3 + 249)), 4, set())
    slot = batch.join(0, _prompts(2)[1], 150, set())
    with pytest.raises(NoRoom, match="KV pool"):
        batch.join(1, _prompts(1)[0], 230, set())
    assert batch.free == 1
    errors = {}
    while batch.active:
        for key, o in batch.cycle():
            if isinstance(o, BaseException):
                errors[key] = o
    assert isinstance(errors.pop("too long"), PromptError) and not errors
    assert set(batch.pool.ranges) == {slot}  # the failed one had no range; the finished one's is kept
