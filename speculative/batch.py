"""Several generations at once, a cycle at a time together (issue 42: continuous batching, Lookahead's batch
inference, llama.cpp's slots).

Each generation runs the one speculation cycle (speculative/loop.py `Speculation.steps`) with a draft side of its
own; the batch's governor sizes every generation's tree from the load (`join`). The trees they ask for are grown
together (`propose`), and what they ask of the target (a prefill chunk, a plain step, a tree to verify) is collected
from every generation in the batch and answered in one forward (`BatchTarget.answer`: speculative/verify.py `LocalBatch` in
this process, scheduler/generation/target_side.py `ActorBatch` over the verifier actor, where a streamed layer is
then read once for every generation). Generations join and leave between cycles; each keeps its own stop tokens,
sampling, rollback and stats, and a greedy one's tokens are exactly those it would make alone.

    batch = Lockstep(loop, target, drafts, slots=4)
    batch.join("a", prompt_ids, 64, stop)
    while batch.active:
        for key, outcome in batch.cycle():   # a CycleOutcome per generation, or the exception that ended it
            ...

Torch-free: the scheduler process runs it.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass
from typing import Callable, Hashable, Iterator

from common.errors import CadenceError
from common.settings import PLAIN, PREFILL_CHUNK, Arm, SamplingConfig, TreeConfig
from speculative.governor import CatchUp, Governor, resident_batch_governor
from speculative.kvpool import KVPool, Placed, SlotTexts
from speculative.sides import (
    Alone,
    BatchTarget,
    Call,
    CycleOutcome,
    DraftSide,
    NoAhead,
    Propose,
    Start,
    TakeStats,
    Verify,
    slack,
)

WIDEST = 32  # the widest tree a generation of a batch verifies (the widest a budgeted run alone tries: WIDER)


@dataclass
class _Generation:
    key: Hashable
    slot: int
    steps: Iterator
    draft: DraftSide | None
    rows: int = 0  # its prompt's tokens (a cycle admits prompts of at most a prefill chunk's rows together)
    reply: object = None  # the draft's tree for its last call, until it takes it
    called: bool = False  # its first call is made
    waiting: Call | None = None  # its start, while its prompt has chunks still to prefill (one a cycle)
    placed: Placed | None = None  # its target cache's range of the batch's KV pool
    call: Call | None = None  # a call it made while taking its answer, made at the next cycle


class NoRoom(CadenceError):
    """The batch's KV pool has no room for the generation now: it joins when one that runs ends."""


class Lockstep:
    def __init__(
        self,
        loop,
        target: BatchTarget,
        drafts: Callable[[int], DraftSide | None],
        slots: int,
        propose: Callable[[list], list] | None = None,
        kv_size: Callable[[int], int] | None = None,
    ):
        """`loop`: the run's cycle (mode, tree settings, sampling, context); `target`: the batch's target side;
        `drafts(slot)`: a slot's own draft side (None in a target-only mode); `slots`: the most generations at once;
        `propose([(draft side, budget)])`: their trees, grown in shared draft forwards (default: one after another);
        `kv_size(rows)`: a target cache's elements, where the slots' caches share one pool of `slots` contexts
        (speculative/kvpool.py). Nothing drafts ahead of a batch's verification: over the actors it cost the
        verifier's compute more than the chains saved (BENCHMARKS.md)."""
        if slots < 1:
            raise CadenceError(f"a batch needs at least one slot, not {slots}")
        self.loop, self.target, self.slots = loop, target, slots
        self.propose = propose or (lambda asks: [d.propose(budget, ahead) for d, budget, ahead in asks])
        self.drafts: dict[int, DraftSide | None] = {}
        self._new_draft = drafts
        self.gens: dict[Hashable, _Generation] = {}
        self.governors: dict[int, dict] = {}  # a slot's governors, kept across the generations it serves
        self.governor: Governor | None = None  # the batch's, choosing every generation's arm this cycle
        self.by_count: dict[int, Governor] | None = None  # resident: a governor per number of generations at once
        self.arm: Arm | None = PLAIN  # the batch governor's choice for this cycle (None: each generation's own)
        self.catchup = CatchUp()  # what a resident batch's next try of drafting would cost
        self.texts = SlotTexts()  # what each slot's cache holds: where a conversation's next turn goes
        self.pool = None
        if kv_size is not None:  # a slot's share: the context and the slack of the widest tree it may get
            share = loop.capacity(loop.context, dataclasses.replace(loop.cfg, width=self.width(loop.cfg, 1)))
            self.pool = KVPool(slots * kv_size(share), kv_size, slots)

    def most_context(self, cfg: TreeConfig | None = None) -> int:
        """The most tokens, prompt and answer, one generation holds: with a pool, what the whole pool holds."""
        cfg = cfg or self.loop.cfg
        if self.pool is None:
            return self.loop.context
        return min(self.loop.model_context, self.pool.most) - slack(cfg)

    def _context(self, n_prompt: int, max_new: int | None, cfg: TreeConfig) -> int | None:
        """A generation's context from the pool: its prompt and new tokens (without a number: a slot's share, or
        half a share past a longer prompt), at most what the pool holds."""
        if self.pool is None:
            return None
        share = self.loop.context
        want = n_prompt + max_new if max_new is not None else max(share, n_prompt + share // 2)
        return min(want, self.most_context(cfg))

    @property
    def active(self) -> int:
        return len(self.gens)

    @property
    def free(self) -> int:
        return self.slots - len(self.gens)

    def join(
        self,
        key: Hashable,
        prompt_ids: list[int],
        max_new: int | None,
        stop: set[int],
        mode: str | None = None,
        cfg: TreeConfig | None = None,
        sampling: SamplingConfig | None = None,
        reuse: bool = True,
    ) -> int:
        """A generation joins at the next cycle, in a free slot (its number returned). `NoRoom`: the KV pool cannot
        hold its context while the others run (it may join when one ends)."""
        if key in self.gens:
            raise CadenceError(f"generation {key!r} is already in the batch")
        taken = {g.slot for g in self.gens.values()}
        slot = self.texts.choose([s for s in range(self.slots) if s not in taken], prompt_ids)
        if slot is None:
            raise CadenceError(f"all {self.slots} slots are taken; wait for a generation to end")
        if slot not in self.drafts:
            self.drafts[slot] = self._new_draft(slot)
        cfg = cfg or self.loop.cfg
        alone = isinstance(self.target, Alone)  # one generation over the run's own sides: as its own governor says
        if not alone and (cfg.ahead or cfg.ahead_auto):  # nothing drafts ahead of a batch, nor needs the rows for it
            cfg = dataclasses.replace(cfg, ahead=0, ahead_auto=False)
        draft = self.drafts[slot]
        size = None
        if not alone and self.target.streamed and draft is not None and draft.has_model:
            # under the wall a forward costs one read of the streamed layers whatever its rows, and the rows the plan
            # holds go to the generations there are (`width`); but the trees are drafted while the read waits, so
            # one governor for the batch weighs narrower trees (less drafting) against the plan's from what the
            # batch's cycles measure (a plain step, a read for one token each, is never worth it here)
            widest = self.width(cfg, 1)  # what it may get alone: its caches' room is sized for that tree
            if self.governor is None and cfg.adaptive:
                sizes = sorted({max(2, cfg.budget // 4), max(2, cfg.budget // 2), cfg.budget, widest})
                self.governor = Governor(tuple(Arm("draft", n) for n in sizes), Arm("draft", cfg.budget), plain=False)
            size = functools.partial(self.width, cfg)
            cfg = dataclasses.replace(cfg, adaptive=False, width=widest)
        elif not alone and draft is not None and draft.has_model and cfg.adaptive:
            # resident, rows cost compute: while the batch holds several generations, a governor for that many
            # picks every one's tree (or a plain step) from what the batch's cycles measure, tokens per second of
            # them all (`cycle`); one generation alone runs as alone, its own governor choosing (`size` None)
            if self.by_count is None:
                self.by_count = {}
            size = lambda: None if self.arm is None else self.arm.size if self.arm.kind == "draft" else 0  # noqa: E731
        context, placed = self._context(len(prompt_ids), max_new, cfg), None
        if context is not None and context >= len(prompt_ids) + (max_new or 1):  # (else the loop says it is too long)
            placed = self.pool.place(slot, self.loop.capacity(context, cfg))
            if placed is None:
                raise NoRoom(f"the KV pool cannot hold {context} more tokens while {len(self.gens)} generations run")
        governors = None if alone else self.governors.setdefault(slot, {})  # alone: the run's own, kept across prompts
        steps = self.loop.steps(
            prompt_ids,
            max_new,
            stop,
            mode,
            cfg,
            sampling,
            reuse,
            draft=draft,
            governors=governors,
            target=self.target if alone else NoAhead(),
            size=size,
            context=context,
        )
        self.gens[key] = _Generation(key, slot, steps, draft, len(prompt_ids), placed=placed)
        self.catchup.join(key, min(len(prompt_ids), cfg.prompt_window or len(prompt_ids)) + 1, self.gens)
        return slot

    def width(self, cfg: TreeConfig, generations: int | None = None) -> int:
        """A streamed batch's tree budget per generation this cycle: the rows of `slots` trees of `cfg.budget` (what
        the plan sized activations for) shared out among the generations there are, at most `WIDEST`; the tree
        the batch's governor plays if it is narrower (the rows the slots free widen it in proportion)."""
        n = generations or max(1, len(self.gens))
        share = max(1, min(WIDEST, self.slots * (cfg.budget + 1) // n - 1))
        if generations is None and self.governor is not None and self.arm is not None and self.arm.kind == "draft":
            return max(1, min(share, self.arm.size * share // max(1, cfg.budget)))
        return share

    def leave(self, key: Hashable) -> None:
        """A generation ends before its time (a client went away): its slot is free at once and its cache goes."""
        if (g := self.gens.pop(key, None)) is not None:
            g.steps.close()
            self._release(g.slot)

    def _release(self, slot: int) -> None:
        """Slot's cache goes (its generation failed or was cancelled), with its range of the pool."""
        self.texts.dropped(slot)
        self.target.release(slot)
        if self.pool is not None:
            self.pool.drop(slot)

    def cycle(self) -> list[tuple[Hashable, CycleOutcome | BaseException]]:
        """Every generation one cycle on: its draft grows its tree, then one forward verifies them all. Returns
        each generation's outcome (a finished one's last carries its `Generation` and leaves the batch), or the
        exception that ended it alone (a prompt that does not fit the context); an error of the target side
        (a dead actor) ends them all and is raised."""
        moving = self._moving()
        if self.by_count is not None:
            n = len(moving)
            if n > 1 and n not in self.by_count:
                self.by_count[n] = resident_batch_governor(self.loop.cfg, lambda: self.catchup.may_try(self.gens))
            self.governor = self.by_count[n] if n > 1 else None
            if self.governor is not None:  # what a try lost at one number of generations it mostly loses at another
                self.governor.gap = max(g.gap for g in self.by_count.values())
        governor = self.governor
        self.arm = governor.choose() if governor is not None else None
        t0 = time.perf_counter()
        outcomes, calls, catchup = [], [], 0.0
        while moving:  # each generation to its target call; the draft trees they ask for on the way grown together
            asks = []
            for g in moving:
                try:
                    call = self._advance(g, outcomes)
                except Exception as e:  # this generation's own failure: the others go on
                    self._failed(g, e, outcomes)
                    continue
                if call is not None:
                    (asks if isinstance(call, Propose) else calls).append((g, call))
            if asks:
                try:
                    trees = self.propose([(g.draft, c.budget, c.ahead) for g, c in asks])
                except BaseException:
                    for g, _ in asks + calls:
                        self.leave(g.key)
                    raise
                for (g, _), p in zip(asks, trees):
                    g.reply = p
                trees = [(g.key, p.tree.catchup_s) for (g, _), p in zip(asks, trees) if p is not None]
                catchup += self.catchup.drafted(trees)  # the drafts' catch-ups
            moving = [g for g, _ in asks]
        if calls:
            try:
                replies = self.target.answer([(g.slot, _placed(c, g.placed)) for g, c in calls])
            except BaseException:
                for g, _ in calls:
                    self.leave(g.key)
                raise
            rows = [(g.key, c, min(g.rows, PREFILL_CHUNK) if isinstance(c, Start) else 1) for g, c in calls]
            self.catchup.answered(rows, time.perf_counter() - t0)
            for (g, c), r in zip(calls, replies):
                # each answered generation takes its answer now: its tokens go out with this cycle, and one that
                # ended frees its slot for a job to join before the next (a long prompt's start waits for its chunks)
                g.waiting = c if isinstance(c, Start) and r is None else None
                if g.waiting is None:
                    self._settle(g, r, outcomes)
            if governor is not None and not any(isinstance(c, Start) for _, c in calls):
                # a cycle of the batch's arm alone (a prompt's pass would price it wrong): the tokens it committed
                made = sum(len(r[0]) + 1 if isinstance(c, Verify) else 1 for (_, c), r in zip(calls, replies))
                # (drafts that missed the text while plain steps ran catch up first: a try of drafting is judged
                # without that forward, which drafting on would not pay again, and a lost try's cost counts it)
                governor.record(self.arm, made, time.perf_counter() - t0, catchup_s=catchup)
        self.catchup.spent += time.perf_counter() - t0
        return outcomes

    def _moving(self) -> list[_Generation]:
        """The generations this cycle moves: every one started (a long prompt a chunk a cycle), and new ones whose
        prompts fill at most a prefill chunk with those (always one, when none is prefilling): a forward's
        activations are those of a chunk and the trees beside it, as the plan counts them."""
        room, out = PREFILL_CHUNK, []
        for g in self.gens.values():
            room -= PREFILL_CHUNK if g.waiting is not None else 0  # a long prompt's next chunk
        for g in self.gens.values():
            if not g.called:
                if room <= 0 or (g.rows > room and room < PREFILL_CHUNK):
                    continue
                room -= g.rows
            out.append(g)
        return out

    def _advance(self, g: _Generation, outcomes: list) -> Call | None:
        """Run a generation until it asks the target for a forward (returned) or ends (None)."""
        if g.waiting is not None:
            return g.waiting
        call, g.call = g.call, None
        reply, g.reply = g.reply, None
        return call or self._run(g, outcomes, reply, until_outcome=False)

    def _settle(self, g: _Generation, reply, outcomes: list) -> None:
        """A generation takes its target's answer as soon as the forward ends, up to the outcome it makes (its
        next arm is chosen at the next cycle, when the batch knows who runs). A failure ends it alone."""
        try:
            g.call = self._run(g, outcomes, reply, until_outcome=True)
        except Exception as e:
            self._failed(g, e, outcomes)

    def _failed(self, g: _Generation, e: Exception, outcomes: list) -> None:
        """A generation's own failure ends it alone: its slot and cache go, its outcome is the exception."""
        self.gens.pop(g.key, None)
        self._release(g.slot)
        outcomes.append((g.key, e))

    def _run(self, g: _Generation, outcomes: list, reply, until_outcome: bool) -> Call | None:
        """Send `reply` to a generation (its first step, if it has made no call) and run it until it asks for a
        forward (returned), makes an outcome (`until_outcome`), or ends (None)."""
        while True:
            try:
                item = g.steps.send(reply) if g.called else next(g.steps)
            except StopIteration:
                self._ended(g)
                return None
            g.called, reply = True, None
            if not isinstance(item, CycleOutcome):  # a call
                if isinstance(item, TakeStats):  # answered here: nothing to compute
                    reply = self.target.take_stats(g.slot)
                    continue
                return item
            outcomes.append((g.key, item))
            if item.result is not None:  # its last outcome: the slot is free for the next cycle
                self._ended(g, item.result)
                return None
            if until_outcome:
                return None

    def _ended(self, g: _Generation, result=None) -> None:
        """A generation's end: its slot is free, its cache's range and text (`result`'s) kept for the next prompt."""
        self.gens.pop(g.key, None)
        if result is not None:
            self.texts.ended(g.slot, [*result.prompt_ids, *result.new_ids])
        if self.pool is not None:
            self.pool.end(g.slot)

    def close(self) -> None:
        """Every generation dropped (the run ends: its processes go with their caches)."""
        for g in self.gens.values():
            g.steps.close()
        self.gens.clear()


def _placed(call: Call, placed: Placed | None) -> Call:
    """A start call with where its cache goes in the pool (None: no pool) and the range's rows (the slot's last cache
    reused only where it kept its range: `Placed.kept`)."""
    if not isinstance(call, Start) or placed is None:
        return call
    return dataclasses.replace(call, capacity=placed.capacity, placed=placed)


def run_all(
    batch: Lockstep, jobs: Iterator[tuple[Hashable, object]], join=None
) -> Iterator[tuple[Hashable, CycleOutcome | BaseException]]:
    """Every job (key, what `join(key, what)` takes; default: `batch.join`'s keyword arguments) through the batch:
    each joins as a slot frees, and each outcome is yielded as its cycle ends. A job that cannot join (a
    CadenceError) is yielded as its error; the others go on."""
    join = join or (lambda key, kw: batch.join(key, **kw))
    jobs = iter(jobs)
    waiting, held = True, None  # held: the job the KV pool had no room for, first to join when one ends
    while True:
        while waiting and batch.free:
            nxt = held or next(jobs, None)
            held = None
            if nxt is None:
                waiting = False
                break
            try:
                join(*nxt)
            except NoRoom as e:
                if batch.active:  # it joins when one of them ends
                    held = nxt
                    break
                yield nxt[0], e  # nothing will end to make room
            except CadenceError as e:
                yield nxt[0], e
        if not batch.active:
            return
        yield from batch.cycle()
