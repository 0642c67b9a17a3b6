"""The driver: runs a pipeline policy against live actors through a scheduler.

Actions become requests (a load first allocates its streaming slot; an action on a slot passes
the slot's descriptor, which `send` leases to the actor until it replies); replies become
events; `Release` frees a slot. Any death, failed op or stall ends the run with one error.
Each finished verification becomes counters in the trace (tokens, accepted length, alpha), a flow
from the draft step that closed the tree to the tree's first verified layer, and an `on_round`
call (the monitor's feed).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from cadence.errors import CadenceError
from scheduler.errors import ActorError, RequestTimeout
from scheduler.policy import Action, PipelinePolicy, Release
from scheduler.runtime import DeadEvent, ErrorEvent, ReplyEvent, Scheduler


@dataclass
class PipelineResult:
    tokens: int
    rounds: int
    alpha: float
    peak_stream_bytes: int  # most loader-slot bytes the allocator ever held
    timeline: list = field(default_factory=list)  # (t_s, "send" | "done", role, op, args)


@dataclass(frozen=True)
class RoundDone:
    """One verification finished."""
    round: int  # 1, 2, ...
    new_tokens: int  # accepted tree tokens + the target's own next token
    tree: int  # tokens in the tree that was verified
    alpha: float  # the fallback threshold after this round's update
    tokens: int  # generated so far

    @property
    def accepted(self) -> int:
        return self.new_tokens - 1


def run_pipeline(sched: Scheduler, policy: PipelinePolicy, stall_s: float | None = None,
                 on_round: Callable[[RoundDone], None] | None = None) -> PipelineResult:
    slots = {}
    inflight: dict[int, Action] = {}
    timeline: list = []
    stream = sched.stream_slots
    t0 = time.monotonic()
    tracing = sched.tracer.enabled
    last_draft = None  # (pid, req) of the latest draft step answered: the tree a verification takes

    def round_done(tokens_before: int) -> None:
        r = RoundDone(policy.rounds, policy.tokens - tokens_before, policy.verify_tree, policy.alpha, policy.tokens)
        if tracing:
            sched.tracer.counter("tokens", {"total": r.tokens})
            sched.tracer.counter("accepted", {"length": r.accepted, "tree": r.tree})
            sched.tracer.counter("alpha", {"alpha": r.alpha})
        if on_round is not None:
            on_round(r)

    def count_slots():
        sched.tracer.counter("loader slots", {"used": stream.used_bytes, "bound": stream.capacity})

    def dispatch(items: list) -> None:
        for it in items:
            if isinstance(it, Release):
                stream.free(slots.pop(it.slot))
                count_slots()
                continue
            tensors = {}
            if it.alloc_bytes:
                slots[it.slot] = stream.alloc(it.alloc_bytes)  # the policy keeps within the bound
                count_slots()
            if it.slot is not None:
                tensors["slot"] = sched.slot_desc(slots[it.slot])
            req_id = sched.send(it.role, it.op, it.args, tensors)
            inflight[req_id] = it
            if tracing and it.op == "verify_layer" and it.args.get("layer") == 0 and last_draft is not None:
                sched.trace.link(last_draft, (sched.actors[it.role].pid, req_id), "draft tree", "tree")
            timeline.append((time.monotonic() - t0, "send", it.role, it.op, it.args))

    limit = stall_s if stall_s is not None else sched.config.timeouts.request_s
    dispatch(policy.start())
    last = time.monotonic()
    while inflight or not policy.done:
        for ev in sched.poll(0.1):
            if isinstance(ev, DeadEvent):
                raise ev.error()
            if isinstance(ev, ErrorEvent):
                raise CadenceError(f"the {ev.role} actor could not read a request: {ev.message}")
            if not isinstance(ev, ReplyEvent) or ev.reply.req_id not in inflight:
                continue  # somebody else's request
            action = inflight.pop(ev.reply.req_id)
            if not ev.reply.ok:
                raise ActorError(ev.role, ev.op, ev.reply.req_id, ev.reply.error)
            timeline.append((time.monotonic() - t0, "done", ev.role, ev.op, action.args))
            if action.op == "draft_step":
                last_draft = (sched.actors[ev.role].pid, ev.reply.req_id)
            rounds, tokens = policy.rounds, policy.tokens
            dispatch(policy.on(policy.event_for(action, ev.reply.result)))
            if policy.rounds != rounds:
                round_done(tokens)
            last = time.monotonic()
        if inflight and time.monotonic() - last > limit:
            req_id = min(inflight)
            raise RequestTimeout(inflight[req_id].role, inflight[req_id].op, req_id, limit)
        if not inflight and not policy.done:
            raise CadenceError("the pipeline policy stalled with nothing in flight; this is a bug in the policy")
    return PipelineResult(policy.tokens, policy.rounds, policy.alpha, stream.peak_bytes, timeline)
