"""The speculation cycle, written once: draft, verify, keep the accepted path, repeat.

`Speculation.steps` is one generation's cycle against the two sides (speculative/sides.py), every forward it needs
yielded as a `Call`. Who answers the calls is always a batch (speculative/batch.py `Lockstep`): of the run's slots,
or, for `stream`, of one generation over the run's own sides (`Alone`), which answers each call as it comes.

Target-only modes (target, std, stdpl) are the same loop with no draft. The governor, the lookup
arm, stop tokens, the KV capacity and the stats live here and nowhere else. `stream` yields one
`CycleOutcome` per cycle; the last carries the finish reason and the `Generation`. Torch-free: the
scheduler process runs this loop.
"""

from __future__ import annotations

import time
from typing import Callable, Iterator

from common.modes import Mode
from common.settings import LOOKUP, PLAIN, Arm, Generation, SamplingConfig, SpecStats, TreeConfig, arms
from speculative.batch import Alone, Lockstep
from speculative.governor import CostModel, Cycle, Governor
from speculative.sides import (
    Call,
    CycleOutcome,
    DraftSide,
    Propose,
    Start,
    Step,
    TakeStats,
    TargetSide,
    Verify,
    limits,
    slack,
)

AHEAD_WAIT = 0.2  # draft ahead while the verifier waits on I/O for more than this share of a verification
STREAM = "stream"  # the key of `stream`'s generation in its batch of one


class Speculation:
    def __init__(
        self,
        target: TargetSide,
        draft: DraftSide | None,
        mode: Mode,
        cfg: TreeConfig,
        sampling: SamplingConfig,
        context: int,
        model_context: int | None = None,
        counter: Callable[[str, dict], None] | None = None,
    ):
        """The run's mode, tree settings and sampling (a generation may ask for others). `context`: the
        tokens a generation holds, prompt and answer; the target's cache is sized to it, so that the next
        prompt that continues this one (a conversation) finds its prefix there. `model_context`: the most
        the model's positions go to (a cache never needs more). `counter(name, values)`: trace counters
        (tokens, accepted length, alpha)."""
        self.target, self.draft, self.mode, self.cfg, self.sampling = target, draft, Mode(mode), cfg, sampling
        self.context, self.model_context = context, model_context or context
        self.counter = counter or (lambda name, values: None)
        self.governors: dict[tuple, Governor] = {}  # per mode and arm set, kept across prompts
        self.bound: int | None = None  # the most new tokens of a generation that asks no number (run, chat)
        self._alone: Lockstep | None = None

    def generate(
        self,
        prompt_ids: list[int],
        max_new: int | None,
        stop: set[int],
        on_cycle: Callable[[CycleOutcome], None] | None = None,
        **kw,
    ) -> Generation:
        """`stream` to its end; `on_cycle(outcome)` after each cycle."""
        for outcome in self.stream(prompt_ids, max_new, stop, **kw):
            if on_cycle:
                on_cycle(outcome)
        return outcome.result

    def stream(
        self,
        prompt_ids: list[int],
        max_new: int | None,
        stop: set[int],
        mode: Mode | None = None,
        cfg: TreeConfig | None = None,
        sampling: SamplingConfig | None = None,
        reuse: bool = True,
    ) -> Iterator[CycleOutcome]:
        """Generate with this run's mode, or another one (`target` always; `chain`/`tree` need a draft):
        a `CycleOutcome` after the prefill and after each cycle. Each is a cycle boundary, where both models'
        caches agree with the text: a consumer may stop there (a client that went away), and the next
        generation starts afresh. `max_new` None: up to the context's end. `reuse` False: the prompt is
        prefilled whole, none of it taken from the last generation's cache. One generation is a batch of one
        (`alone`): the batch's cycle, over this run's own sides."""
        batch = self.alone()
        batch.join(STREAM, prompt_ids, max_new, stop, mode, cfg, sampling, reuse)
        try:
            while batch.active:
                for _, outcome in batch.cycle():
                    if isinstance(outcome, BaseException):
                        raise outcome
                    yield outcome
        finally:
            batch.leave(STREAM)

    def alone(self) -> Lockstep:
        """The batch of one generation over this run's target and draft sides (made at the first ask)."""
        if self._alone is None:
            self._alone = Lockstep(self, Alone(self.target), lambda slot: self.draft, 1)
        return self._alone

    def steps(
        self,
        prompt_ids: list[int],
        max_new: int | None,
        stop: set[int],
        mode: Mode | None = None,
        cfg: TreeConfig | None = None,
        sampling: SamplingConfig | None = None,
        reuse: bool = True,
        draft: DraftSide | None = None,
        governors: dict | None = None,
        target: TargetSide | None = None,
        size: Callable[[], int] | None = None,
        context: int | None = None,
    ) -> Iterator[CycleOutcome | Call]:
        """`stream`, with every call on the target side yielded as a `Call` whose answer is sent back: one
        generation's cycle, whoever computes its verifications. A batch of generations (speculative/batch.py)
        gives each its own `draft` side and `governors`, and answers their calls together; `target` is what the
        I/O-wait rule reads (the run's target side by default); `size()`: each cycle's tree budget where no
        governor chooses, or None where its own does (a batch shares its rows out among the generations it holds;
        one generation alone in a resident batch runs as alone); `context`: this generation's, where a batch's KV
        pool gives it more or less than the run's (speculative/kvpool.py)."""
        mode, cfg = Mode(mode or self.mode), cfg or self.cfg
        draft = draft or self.draft
        speculative = mode.speculative
        if speculative and draft is None:
            raise ValueError(f"mode {mode} needs a draft, which this run did not start")
        if mode is Mode.CHAIN and not draft.has_model:
            raise ValueError("mode chain needs a draft model; --draft none speculates in tree mode only")
        sampling = sampling or self.sampling
        context = context or self.context
        max_new = limits(context, len(prompt_ids), max_new, self.bound)
        t0 = time.perf_counter()
        first, reused = yield Start(prompt_ids, self.capacity(context, cfg), sampling, reuse)
        if speculative:
            window = min(len(prompt_ids), cfg.prompt_window or len(prompt_ids))
            draft.start(prompt_ids, self.capacity(min(context, window + max_new), cfg, True), first, cfg, sampling)
        t_prefill = time.perf_counter() - t0
        governor = self._governor(mode, cfg, draft, governors, target) if speculative else None
        stats = SpecStats()
        out = [first]
        outcome = CycleOutcome([first])
        while not self._finished(out, max_new, stop):
            yield outcome
            arm, own = _choose(governor, size, cfg.budget, speculative)
            room = max_new - len(out) - 1
            arm = _near_end(arm, room)
            stats.arm_hist[str(arm)] = stats.arm_hist.get(str(arm), 0) + 1
            t_cycle = time.perf_counter()
            new, accepted, alpha, measured = yield from self._cycle(
                arm, out[-1], stats, cfg, sampling, draft if speculative else None, target or self.target, room
            )
            dt = time.perf_counter() - t_cycle
            stats.arm_s[str(arm)] = stats.arm_s.get(str(arm), 0.0) + dt
            if governor and own:
                governor.record(arm, len(new), dt, measured)
            for i, tok in enumerate(new):  # stop inside an accepted run
                if tok in stop or len(out) + i + 1 >= max_new:
                    new = new[: i + 1]
                    break
            out.extend(new)
            self.counter("tokens", {"total": len(out)})
            outcome = CycleOutcome(new, accepted, alpha)
        st = stats.as_dict() if speculative else {"target_forwards": stats.target_forwards}
        if speculative:
            st["ahead_steps"], st["ahead_reused"] = draft.ahead_counts()
            st.update(draft.take_stats())
        st["reused_prompt_tokens"] = reused  # found in the KV cache from the last generation
        st.update((yield TakeStats()))
        if "logprobs" in st:  # a verification's tokens past a stop or the limit were never committed
            st["logprobs"] = st["logprobs"][: len(out)]
        result = Generation(prompt_ids, out, time.perf_counter() - t0, t_prefill, st)
        yield CycleOutcome(
            outcome.tokens, outcome.accepted, outcome.alpha, "stop" if out[-1] in stop else "length", result
        )

    def capacity(self, context: int, cfg: TreeConfig, draft: bool = False) -> int:
        """KV rows the target's (`draft`: the draft's) caches of `context` tokens fill with trees of `cfg`."""
        return min(self.model_context, context + slack(cfg, draft))

    @staticmethod
    def _finished(out: list[int], max_new: int, stop: set[int]) -> bool:
        return len(out) >= max_new or out[-1] in stop

    def _governor(self, mode: Mode, cfg: TreeConfig, draft: DraftSide, kept: dict | None, target) -> Governor | None:
        """What speculation earned on earlier prompts carries over (`kept`, else this run's). No draft model: the
        trie or a plain step. Where the target streams, a forward is one read whatever its rows, and a draft's tree
        (the trie's candidates in it) earns at least what a plain step or the trie would for it: tree sizes only,
        no read spent measuring those."""
        if not (cfg.adaptive or not draft.has_model):
            return None
        wall = (target or self.target).streamed and draft.has_model
        choices = tuple(a for a in arms(cfg, draft.has_model) if a.kind == "draft" or not wall)
        start = Arm("draft", cfg.budget) if draft.has_model else LOOKUP
        model = CostModel(worth_priced=cfg.growth == "best")
        kept = self.governors if kept is None else kept
        governor = kept.setdefault((mode, choices), Governor(choices, start, plain=not wall, model=model))
        governor.new_text()
        return governor

    def ahead_steps(self, cfg: TreeConfig, target: TargetSide | None = None) -> int:
        """Draft forwards the draft may run during this verification (LLMCad's speculative drafting).
        Two cores cannot draft and verify at once for free: with `ahead_auto` the draft drafts ahead
        only while the verifier spends more than AHEAD_WAIT of its verifications waiting for layers
        (measured, a moving average), when a core would idle otherwise. (In one process the draft runs
        its chain ahead before the verification, not beside it: only a fixed `ahead` asks for that.)"""
        if not cfg.ahead_auto:
            return cfg.ahead
        target = target or self.target
        if not target.streamed:
            return 0
        w = target.io_wait
        return cfg.ahead if w is None or w > AHEAD_WAIT else 0

    def _cycle(
        self,
        arm: Arm,
        root: int,
        stats: SpecStats,
        cfg: TreeConfig,
        sampling: SamplingConfig,
        draft: DraftSide | None,
        target: TargetSide,
        room: int,
    ):
        """One draft-verify cycle, its target calls yielded: (the committed tokens, accepted draft tokens, alpha,
        what a draft cycle measured for the governor). `room`: the most nodes a tree may have (the end is near)."""
        stats.target_forwards += 1
        p = None
        t = time.perf_counter()
        drafting = 0.0
        if arm.kind == "draft":  # drafting on while the target verifies: the verdict interrupts it
            p = yield Propose(arm.size, self.ahead_steps(cfg, target) if sampling.plain else 0)
            drafting = time.perf_counter() - t
            stats.draft_s += drafting
        elif arm.kind == "lookup":
            p = draft.lookup(min(cfg.width, room))
        t = time.perf_counter()
        if p is None or not p.tokens:
            nxt = yield Step(root)
            stats.plain_steps += 1
            if draft is not None:
                draft.advance(p if arm.kind == "draft" else None, [], [nxt])
            stats.verify_s += time.perf_counter() - t
            return [nxt], None, None, None
        path, nxt = yield Verify(p)
        new = [p.tokens[i] for i in path] + [nxt]
        alpha = draft.advance(p if p.drafted else None, path, new)
        verifying = time.perf_counter() - t
        stats.verify_s += verifying
        stats.record_verification(p.tree, path)
        self.counter("accepted", {"length": len(path), "tree": len(p.tokens)})
        if alpha is not None:
            stats.alpha.append(alpha)
            self.counter("alpha", {"alpha": alpha})
        if not p.drafted:  # the trie's candidates: no draft budget to price
            return new, len(path), alpha, None
        t = p.tree  # a catch-up forward is the price of having stepped plainly, not of this budget
        forwards = t.forwards - (t.catchup_s > 0)
        return (
            new,
            len(path),
            alpha,
            Cycle(drafting - t.catchup_s, verifying, forwards, len(t.tokens) + 1, t.depth, len(path), t.worth),
        )


def _near_end(arm: Arm, room: int) -> Arm:
    """A cycle's arm where `room` tokens are left before the limit: a smaller tree, or a plain step where no draft
    token or trie candidate fits (the trie's are cut to `room` as they are taken)."""
    if arm.kind == "draft" and arm.size > room:
        return Arm("draft", room) if room > 0 else PLAIN
    return PLAIN if arm.kind == "lookup" and room <= 0 else arm


def _choose(governor: Governor | None, size: Callable[[], int | None] | None, budget: int, speculative: bool):
    """A cycle's arm, and whether the generation's own governor chose it: `size()` is a batch's choice of tree
    (0: a plain step), or None where the generation's own governor (else its `budget`) decides."""
    width = size() if size is not None else None
    if width is None and governor is not None:
        return governor.choose(), True
    width = budget if width is None else width
    return (Arm("draft", width) if speculative and width else PLAIN), False
