"""The scheduler's event pump: frames and process exits in, events and deadlines out.

A mixin of `Runtime` (scheduler/runtime.py), which owns the state it works on: `_router` and
`_poller` (the ROUTER socket and, beside it, each actor's pidfd sentinel), `actors`, `_sentinels`,
`_pending` and `_queued` (requests awaiting replies), `events` and `_listeners`, `ledger`, `tracer`,
`trace`, `config`, `arenas`, `t0_ns`, `pid`. Everything that happens reaches the caller as one
event: a ReplyEvent, an ErrorEvent, or a DeadEvent however the actor died.
"""

from __future__ import annotations

import logging
import time

import zmq

from actors import wire
from common.errors import CadenceError
from scheduler.errors import ActorDead
from scheduler.events import DeadEvent, ErrorEvent, ReplyEvent
from scheduler.procs import (
    DEAD,
    INITIALIZING,
    READY,
    STARTING,
    STOPPING,
    ActorProc,
    close_sentinel,
    exit_reason,
    kill_tree,
)

log = logging.getLogger("cadence.scheduler")
_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)


class EventPump:
    """Receiving, sending and the bookkeeping of deaths and deadlines; the public verbs are Runtime's."""

    def _live(self, role: str) -> ActorProc:
        proc = self.actors.get(role)
        if proc is None:
            raise CadenceError(f"there is no {role} actor; spawn it first")
        if proc.state == DEAD:
            raise ActorDead(role, proc.reason)
        if proc.state != READY:
            raise CadenceError(f"the {role} actor is not READY yet ({proc.state}); call wait_ready first")
        return proc

    def _send_frames(self, role: str, frames: list) -> None:
        try:
            wire.send(self._router, frames, prefix=role.encode())
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            proc = self.actors[role]
            deadline = time.monotonic() + 1.0
            while proc.state != DEAD and time.monotonic() < deadline:
                self._pump(0.05)  # its socket closed, so it is exiting: let the sentinel say how
            if proc.state != DEAD:
                self._give_up(proc, "closed its socket")
            raise ActorDead(role, proc.reason) from None

    def _pump(self, timeout_s: float) -> None:
        ready = dict(self._poller.poll(max(timeout_s, 0) * 1000))
        if self._router in ready:
            # drain all before checking deadlines: a backlog of heartbeats must not look like silence
            while self._router.getsockopt(_EVENTS) & _POLLIN:  # ints: pyzmq's flag enums are slow
                self._on_frames(wire.recv(self._router, _NOBLOCK))
        for fd in ready:
            if fd in self._sentinels:
                self._on_exit(self.actors[self._sentinels[fd]])
        self._check_deadlines()
        self._maybe_sample()
        if len(self.tracer.events) >= 2048:  # our own spans go to the sink as the run goes (it spills, under a budget)
            self.trace.add(self.pid, self.tracer.drain())

    def _on_frames(self, frames: list) -> None:
        role = frames[0].decode(errors="replace")
        proc = self.actors.get(role)
        if proc is None:
            log.warning("cadence: dropped a message from unknown peer %r", role)
            return
        proc.last_seen = time.monotonic()
        try:
            msg = wire.decode(frames[1:])
        except wire.WireError as e:
            self.bad_frames += 1
            if self.bad_frames <= 10 or self.bad_frames % 1000 == 0:  # a flood must not flood the log
                log.warning("cadence: bad frame #%d, from the %s actor: %s", self.bad_frames, role, e)
            return self._answer(proc, wire.Error(None, str(e)))
        kind = type(msg)
        if kind is wire.Reply:
            self._on_reply(role, msg)
        elif kind is wire.TraceBatch:
            self.trace.add(msg.pid, msg.events)
        elif kind is wire.Heartbeat:
            pass
        elif kind is wire.Hello and proc.state == STARTING:
            proc.state, proc.deadline = INITIALIZING, time.monotonic() + self.config.timeouts.init_s
            init = wire.Init(
                proc.init, list(self.arenas), self.t0_ns, self.config.timeouts.heartbeat_every_s, self.tracer.enabled
            )
            self._answer(proc, init)
        elif kind is wire.Ready and proc.state == INITIALIZING:
            proc.state, proc.actor, proc.ops = READY, msg.actor, msg.ops
            self.ledger.watch(role, proc.pid)
            self.trace.name_process(proc.pid, f"{role} ({msg.actor})")
        elif kind is wire.Dead:
            proc.said = msg.reason
            if proc.state not in (STOPPING, DEAD):
                self._mark_dead(proc, msg.reason)
        elif kind is wire.Error:
            pending = self._pending.get(msg.req_id) if msg.req_id is not None else None
            if pending is not None and pending.role == role:
                self._on_reply(role, wire.Reply(msg.req_id, False, {}, {}, msg.message))
            else:
                self._emit(ErrorEvent(role, msg.message))
        else:
            self._answer(
                proc, wire.Error(None, f"unexpected {kind.__name__} from the {role} actor in state {proc.state}")
            )

    def _answer(self, proc: ActorProc, msg: wire.Msg) -> None:
        try:
            self._send_frames(proc.role, wire.encode(msg))
        except ActorDead:
            pass

    def _on_reply(self, role: str, reply: wire.Reply) -> None:
        p = self._pending.get(reply.req_id)
        if p is None or p.role != role:
            log.debug("dropped a reply to unknown request %d from %s", reply.req_id, role)
            return
        del self._pending[reply.req_id]
        for alloc, slot in p.leases:
            alloc.release(slot, role)
        if p.abandoned:
            return
        self._emit(ReplyEvent(role, p.op, reply))
        self._count_queue(role, -1)

    def _emit(self, ev) -> None:
        self.events.append(ev)
        for fn in tuple(self._listeners) if self._listeners else ():
            try:
                fn(ev)
            except Exception:
                log.exception("cadence: an event listener failed; it is removed")
                self._listeners.remove(fn)

    def _abandon(self, req_id: int) -> None:
        p = self._pending.get(req_id)
        if p is not None:
            # the actor may still read these slots: they stay leased until its late reply (or death)
            p.abandoned = True
            self._count_queue(p.role, -1)

    def _on_exit(self, proc: ActorProc) -> None:
        self._poller.unregister(proc.sentinel)
        self._sentinels.pop(proc.sentinel, None)
        close_sentinel(proc)
        rc = proc.popen.wait()  # the pidfd said it exited: this only reaps
        if proc.state == STOPPING:
            proc.state, proc.reason = DEAD, "was stopped"
        elif proc.state != DEAD:
            self._mark_dead(proc, proc.said or exit_reason(rc))

    def _give_up(self, proc: ActorProc, reason: str) -> None:
        kill_tree(proc.popen, timeout=0.5)
        self._mark_dead(proc, reason)

    def _mark_dead(self, proc: ActorProc, reason: str) -> None:
        proc.state, proc.reason = DEAD, reason
        self.ledger.unwatch(proc.role)
        log.error("cadence: the %s actor %s", proc.role, reason)
        for req_id in [r for r, p in self._pending.items() if p.role == proc.role]:
            for alloc, slot in self._pending.pop(req_id).leases:
                alloc.release(slot, proc.role)  # a dead reader reads nothing more
        self._count_queue(proc.role, -self._queued[proc.role])
        self.tracer.instant(f"{proc.role} died", cat="scheduler", args={"reason": reason})
        self._emit(DeadEvent(proc.role, reason))

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        for proc in self.actors.values():
            reason = proc.overdue(now, self.config.timeouts)
            if reason:
                self._give_up(proc, reason)

    def _count_queue(self, role: str, delta: int) -> None:
        self._queued[role] += delta
        if self.tracer.enabled:
            self.tracer.counter(f"queue {role}", {"pending": self._queued[role]})

    def _maybe_sample(self) -> None:
        """The ledger samples on its own thread; a new sample becomes a trace counter here."""
        if self.ledger.samples != self._samples_seen:
            self._samples_seen = self.ledger.samples
            self.tracer.counter(
                "memory",
                {"held": self.ledger.held_total(), "pss_total": self.ledger.pss_total(), "budget": self.ledger.budget},
            )
