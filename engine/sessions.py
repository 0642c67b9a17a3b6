"""Where a run's models live, behind one `Session` protocol that the runner streams from the same way:

- `ActorsSession`: the scheduler and the actors under it (scheduler/generation/session.py `ActorSession`: the
  verifier, the loader when layers stream, the draft, the sparse worker), the default;
- `LocalSession`: the models in this process (`--runtime inproc`);
- `FlashSession` (engine/flash.py): LLM in a flash's sparse FFN in this process (`--mode flash`, APPROXIMATE).

`open_session(plan)` picks one from the `RunPlan` (engine/plan.py); the runner never asks which it got.
"""

from __future__ import annotations

from typing import Protocol

from common.errors import CadenceError
from engine.plan import DraftKind, Mode, Runtime, RunPlan


class Session(Protocol):
    loop: object  # the speculation cycle (speculative/loop.py `Speculation`)
    sched: object  # the scheduler (scheduler/runtime.py `Runtime`) where the models are actors, else None
    streamer: object  # the loader's side of a streamed target (scheduler/generation/streaming.py), or None
    experts: object  # a mixture of experts' buffer under a budget (scheduler/generation/experts.py), or None

    def start_generation(self) -> None:
        """Before a generation: per-generation counters start afresh."""

    def fields(self, tokens: int) -> dict:
        """What a finished generation's row adds (`tokens`: how many it made): {} where nothing."""

    def lines(self) -> list[str]:
        """What the session adds to the run's start line (its own memory arrangement): [] where nothing."""

    def batch(self, slots: int):
        """Up to `slots` generations at once, a cycle at a time together (speculative/batch.py `Lockstep`)."""

    def close(self) -> None: ...


def open_session(plan: RunPlan) -> Session:
    if plan.mode is Mode.FLASH:  # approximate, in this process, its own memory arrangement (engine/flash.py)
        from engine.flash import FlashSession

        return FlashSession(plan)
    if plan.runtime is Runtime.INPROC:
        return LocalSession(plan)
    return ActorsSession(plan)


class _Quiet:
    """What a session without per-generation figures says: nothing."""

    streamer = experts = sched = None

    def start_generation(self) -> None:
        pass

    def fields(self, tokens: int) -> dict:
        return {}

    def lines(self) -> list[str]:
        return []

    def batch(self, slots: int):
        raise CadenceError(
            "this run generates one prompt at a time (--parallel takes the tree, chain and target modes)"
        )


class LocalSession(_Quiet):
    """The models in this process: the cycle over `LocalTarget` and `LocalDraft` (or the trie alone)."""

    def __init__(self, plan: RunPlan):
        import torch

        from formats import loading
        from speculative.drafter import LocalDraft
        from speculative.lookup import TrieDraft

        torch.set_num_threads(plan.threads)
        if plan.device.startswith("cuda") and not torch.cuda.is_available():
            raise CadenceError("--device cuda was asked for but torch sees no CUDA device; use --device cpu")
        self.target = loading.load_store(plan.target, plan.target_name, plan.device)
        self.target.model.kv_dtype = plan.kv_dtype
        d = plan.draft
        self._drafts = lambda slot: None  # a draft side of its own for each slot of a batch
        if d.kind is DraftKind.FLASH:  # the target's own sparse FFN (flash/sparse_target.py)
            from flash.sparse_target import flash_draft

            model = flash_draft(self.target.model, plan.target, plan.ffn_density)
            model.kv_dtype = d.kv_dtype
            self._drafts = lambda slot: LocalDraft(model)
        elif d.model:
            self.draft = loading.load_store(d.store, d.name, plan.device, d.head_rows)
            self.draft.model.kv_dtype = d.kv_dtype
            self._drafts = lambda slot: LocalDraft(self.draft.model)
        elif d.kind is DraftKind.TRIE:
            vocab = (str(self.target.store.dir), self.target.args.vocab_size)
            self._drafts = lambda slot: TrieDraft(plan.tree.width, vocab)
        self.prefixes = plan.prefixes()  # one prompt cache for a generation alone and a batch's
        self.loop = plan.local_cycle(self.target.model, self._drafts(0), self.prefixes)

    def batch(self, slots: int):
        from speculative.batch import Lockstep
        from speculative.slots import LocalBatch

        args = self.target.model.args
        kv = lambda rows: args.kv_bytes(rows, self.target.model.kv_dtype) // 4  # noqa: E731
        return Lockstep(self.loop, LocalBatch(self.target.model, self.prefixes), self._drafts, slots, _propose, kv)

    def close(self) -> None:
        pass


def _propose(asks: list) -> list:
    """A batch's trees: grown in shared draft forwards where every side is a draft model in this process."""
    from speculative.drafter import LocalDraft

    if all(isinstance(d, LocalDraft) for d, _, _ in asks):
        return LocalDraft.propose_many(asks)
    return [d.propose(budget, ahead) for d, budget, ahead in asks]


class ActorsSession(_Quiet):
    """The scheduler (its arena, sockets, watchdog) and the run's actors under it; closing it stops them all."""

    def __init__(self, plan: RunPlan):
        from scheduler.runtime import Runtime as Scheduler

        self.sched = Scheduler(plan.scheduler).__enter__()
        try:
            self._session = _actor_session(self.sched, plan)
        except BaseException:
            self.sched.shutdown()
            raise
        self.loop, self.target = self._session.loop, self._session.target

    def batch(self, slots: int):
        return self._session.batch(slots)

    @property
    def streamer(self):
        return self._session.streamer

    @property
    def experts(self):
        return self._session.experts

    def close(self) -> None:
        try:
            self._session.close()
        finally:
            self.sched.shutdown()


def _actor_session(sched, plan: RunPlan):
    from scheduler.generation.session import ActorSession, SessionSpec

    d = plan.draft
    spec = SessionSpec(
        mode=plan.mode,
        target_store=str(plan.target.dir),
        model=plan.target.args,
        draft_store=str(d.store.dir) if d.model else None,
        sampling=plan.sampling,
        tree=plan.tree,
        threads=plan.threads,
        context=plan.context,
        plan=plan.memory,
        worker=plan.worker,
        experts=plan.experts,
        paths=plan.paths,
        draft_rows=d.head_rows,
        flash=d.flash,
        prompt_cache=plan.prompt_cache,
        kv_dtype=plan.kv_dtype,
        draft_kv_dtype=d.kv_dtype,
    )
    return ActorSession(sched, spec)
