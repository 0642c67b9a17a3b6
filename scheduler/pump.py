"""The scheduler's message pump: the ROUTER socket each actor's DEALER connects to, the requests in
flight and their replies, and the one loop (`turn`) that waits on the socket and the actors' exits.

`MessagePump` owns the socket and its poller, the requests awaiting replies (with the slots each one
leases), the events not yet handed out and their listeners. The actors' processes are the supervisor's
(supervisor.py): the pump reads its `ActorProc`s and tells it what it heard; a request's tensors become
descriptors through the exchange (exchange.py). Everything that happens reaches the caller as one
event: a ReplyEvent, an ErrorEvent, or a DeadEvent however the actor died (a DEAD frame, its sentinel,
a missed deadline, a closed socket).
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque

import zmq

from actors import wire
from actors.tracing import Tracer
from scheduler.errors import ActorDead, ActorError, RequestTimeout
from scheduler.events import DeadEvent, ErrorEvent, Pending, ReplyEvent
from scheduler.exchange import TensorExchange
from scheduler.ledger import MemoryLedger
from scheduler.procs import DEAD, INITIALIZING, STARTING, STOPPING, ActorProc
from scheduler.runtime_config import Timeouts
from scheduler.supervisor import Supervisor
from scheduler.trace import TraceSink

log = logging.getLogger("cadence.scheduler")
_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)


def bind_router(zctx: zmq.Context, endpoint: str) -> zmq.Socket:
    """The scheduler's one control socket; each actor connects a DEALER named after its role."""
    router = zctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a vanished actor raises, not drops
    router.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a respawned role takes its identity over
    router.setsockopt(zmq.SNDHWM, 0)
    router.setsockopt(zmq.RCVHWM, 0)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(endpoint)
    return router


class MessagePump:
    """Requests out, replies and deaths in. `open` binds the socket; `turn` runs the loop once."""

    def __init__(
        self,
        supervisor: Supervisor,
        *,
        timeouts: Timeouts,
        tracer: Tracer,
        trace: TraceSink,
        ledger: MemoryLedger,
        pid: int,
        t0_ns: int,
    ):
        self.supervisor = supervisor
        self.timeouts = timeouts
        self.tracer = tracer
        self.trace = trace
        self.ledger = ledger
        self.pid = pid  # the scheduler's: whose spans `tracer` records
        self.t0_ns = t0_ns  # the run's clock, which the actors' trace events count from
        self.bad_frames = 0  # malformed frames received (each was answered with an Error)
        self._events: deque = deque()
        self._listeners: list = []  # add_listener: called with each event as it arrives
        self._pending: dict[int, Pending] = {}
        self._queued: Counter = Counter()  # role -> requests awaiting a reply (not abandoned)
        self._next_req = 1
        self._samples_seen = 0
        self._exchange: TensorExchange | None = None
        self._router = self._zctx = self._poller = None

    # -- the socket -----------------------------------------------------------------------------

    def open(self, endpoint: str, exchange: TensorExchange) -> None:
        """Bind the ROUTER at `endpoint`; the actors will map the exchange's segments."""
        self._exchange = exchange
        self._zctx = zmq.Context()
        self._router = bind_router(self._zctx, endpoint)
        self._poller = zmq.Poller()
        self._poller.register(self._router, zmq.POLLIN)

    @property
    def opened(self) -> bool:
        return self._poller is not None

    def watch(self, sentinel: int) -> None:
        """Wait on an actor's sentinel in the loop too: a SIGKILLed actor is noticed at once."""
        self._poller.register(sentinel, zmq.POLLIN)

    def close(self) -> None:
        try:
            if self._router is not None:
                self._router.close(linger=0)
        finally:
            if self._zctx is not None:
                self._zctx.term()

    # -- requests -------------------------------------------------------------------------------

    def send(self, role: str, op: str, args: dict, tensors: dict, lease: bool) -> int:
        """Queue a request to the READY `role` actor; returns its id (Runtime.send says the rest)."""
        proc = self.supervisor.live(role)
        req_id = self._next_req
        self._next_req += 1
        wire_tensors, leases = self._exchange.wire_tensors(role, tensors, lease)
        flow = req_id if self.tracer.enabled else None
        try:
            with self.tracer.span(f"send {op}", cat="scheduler", args={"to": role, "req": req_id}, flow_out=flow):
                self._send_frames(proc.role, wire.encode(wire.Request(op, args, wire_tensors, req_id, flow)))
        except BaseException:
            for alloc, slot in leases:
                alloc.release(slot, role)
            raise
        self._pending[req_id] = Pending(role, op, leases, sent=time.monotonic())
        self._count_queue(role, +1)
        return req_id

    def wait_reply(self, role: str, op: str, req_id: int, limit: float) -> wire.Reply:
        """The reply to request `req_id`, within `limit` seconds. ActorError, ActorDead, RequestTimeout."""
        deadline = time.monotonic() + limit
        while True:
            reply = self._pop_reply(req_id)
            if reply is not None:
                if not reply.ok:
                    raise ActorError(role, op, req_id, reply.error)
                return reply
            proc = self.supervisor.actors[role]
            if proc.state == DEAD:
                raise ActorDead(role, proc.reason)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._abandon(req_id)
                raise RequestTimeout(role, op, req_id, limit)
            self.turn(min(remaining, 0.1))

    def take_reply(self, req_id: int) -> wire.Reply | None:
        self.turn(0)
        return self._pop_reply(req_id)

    def _pop_reply(self, req_id: int) -> wire.Reply | None:
        for ev in self._events:
            if isinstance(ev, ReplyEvent) and ev.reply.req_id == req_id:
                self._events.remove(ev)
                return ev.reply
        return None

    def poll(self, timeout: float) -> list:
        deadline = time.monotonic() + timeout
        self.turn(0)
        while not self._events:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            self.turn(min(remaining, 0.1))
        out = list(self._events)
        self._events.clear()
        return out

    def pending(self, role: str | None = None) -> int:
        return self._queued[role] if role is not None else sum(self._queued.values())

    def current(self) -> dict[str, Pending]:
        """Each busy actor's oldest request awaiting a reply (what it works on now). Safe from another
        thread: it reads a copy of the table."""
        oldest: dict[str, tuple[int, Pending]] = {}
        for req_id, p in list(self._pending.items()):
            if p.role not in oldest or req_id < oldest[p.role][0]:
                oldest[p.role] = (req_id, p)
        return {role: p for role, (_, p) in oldest.items()}

    def add_listener(self, fn) -> None:
        self._listeners.append(fn)

    def remove_listener(self, fn) -> None:
        if fn in self._listeners:
            self._listeners.remove(fn)

    @property
    def listeners(self) -> list:
        return list(self._listeners)

    def tell(self, role: str, msg: wire.Msg) -> None:
        """A message that is no request (STOP): ActorDead if the actor is gone, zmq.ZMQError if the socket failed."""
        self._send_frames(role, wire.encode(msg))

    def send_raw(self, role: str, frames: list[bytes]) -> None:
        self._send_frames(self.supervisor.live(role).role, frames)

    def _send_frames(self, role: str, frames: list) -> None:
        try:
            wire.send(self._router, frames, prefix=role.encode())
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            proc = self.supervisor.actors[role]
            deadline = time.monotonic() + 1.0
            while proc.state != DEAD and time.monotonic() < deadline:
                self.turn(0.05)  # its socket closed, so it is exiting: let the sentinel say how
            if proc.state != DEAD:
                self._give_up(proc, "closed its socket")
            raise ActorDead(role, proc.reason) from None

    # -- the loop -------------------------------------------------------------------------------

    def turn(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for frames or exits, handle all that came, then the deadlines."""
        ready = dict(self._poller.poll(max(timeout_s, 0) * 1000))
        if self._router in ready:
            self._drain()  # all before the deadlines: a backlog of heartbeats must not look like silence
        for fd in ready:
            proc = self.supervisor.sentinel_of(fd)
            if proc is not None:
                self._poller.unregister(fd)
                self._last_word(proc)
                reason = self.supervisor.reap(proc)
                if reason is not None:
                    self._died(proc, reason)
        for proc, reason in self.supervisor.overdue():
            self._give_up(proc, reason)
        self._maybe_sample()
        if len(self.tracer.events) >= 2048:  # our own spans go to the sink as the run goes (it spills, under a budget)
            self.trace.add(self.pid, self.tracer.drain())

    def _drain(self) -> None:
        while self._router.getsockopt(_EVENTS) & _POLLIN:  # ints: pyzmq's flag enums are slow
            self._on_frames(wire.recv(self._router, _NOBLOCK))

    def _last_word(self, proc: ActorProc, wait_s: float = 0.2) -> None:
        """An actor that exited may have said why just before (a DEAD frame): its frame can reach the router after
        its exit shows, on a busy machine. Wait a moment for it, so that the reason reported is its own."""
        deadline = time.monotonic() + wait_s
        while proc.said is None and proc.state not in (DEAD, STOPPING) and time.monotonic() < deadline:
            if self._router.poll(20):
                self._drain()

    def _on_frames(self, frames: list) -> None:
        role = frames[0].decode(errors="replace")
        proc = self.supervisor.actors.get(role)
        if proc is None:
            log.warning("cadence: dropped a message from unknown peer %r", role)
            return
        self.supervisor.heard(proc)
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
            self.supervisor.hello(proc)
            segments = self._exchange.segments
            self._answer(
                proc, wire.Init(proc.init, segments, self.t0_ns, self.timeouts.heartbeat_every_s, self.tracer.enabled)
            )
        elif kind is wire.Ready and proc.state == INITIALIZING:
            self.supervisor.ready(proc, msg.actor, msg.ops)
        elif kind is wire.Dead:
            if self.supervisor.last_word(proc, msg.reason):
                self._died(proc, msg.reason)
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
        self._events.append(ev)
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

    def _give_up(self, proc: ActorProc, reason: str) -> None:
        self.supervisor.kill(proc)
        self._died(proc, reason)

    def _died(self, proc: ActorProc, reason: str) -> None:
        self.supervisor.mark_dead(proc, reason)
        for req_id in [r for r, p in self._pending.items() if p.role == proc.role]:
            for alloc, slot in self._pending.pop(req_id).leases:
                alloc.release(slot, proc.role)  # a dead reader reads nothing more
        self._count_queue(proc.role, -self._queued[proc.role])
        self.tracer.instant(f"{proc.role} died", cat="scheduler", args={"reason": reason})
        self._emit(DeadEvent(proc.role, reason))

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
