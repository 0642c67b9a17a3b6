"""The actor runtime of the scheduler process: it owns the run (arena, sockets, actor processes, trace),
supervises the actors and relays requests to them and their replies back. What to ask of whom, and
when, is decided above it (scheduler/generation/: the speculation cycle's sides, the layer streamer,
the expert buffer).

    with Runtime(config) as s:                      # plan memory, sweep, arena, ROUTER, watchdog
        s.spawn("verifier", "actors.verifier:VerifierActor", {...})  # HELLO -> INIT -> READY, each step timed
        reply = s.call("verifier", Layer("layer.3"), tensors={"slot": desc})   # a payload (actors/ops.py)
        rid = s.send("loader", Load("layer.4"), ...); events = s.poll(0.1)   # replies, deaths, errors
    # exit: STOP, join to timeouts.shutdown_s, kill the trees, unlink, write traces/<run-id>.json

Deaths are seen two ways: a DEAD frame (the actor's own last word) and the process sentinel (a
pidfd in the same zmq Poller), so a SIGKILLed actor is noticed at once. Either way the caller
gets one `ActorDead(role, reason)`. A watchdog process unlinks everything if we die instead.
Two mixins hold the rest: the event pump (frames, exits, deadlines: scheduler/pump.py) and the
tensors in requests (scheduler/exchange.py).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
import time
from collections import Counter, deque

import zmq

from actors import wire
from actors.ops import Payload
from actors.tracing import Tracer
from common.errors import CadenceError, Terminated
from common.procname import set_process_name
from scheduler.runtime_config import RuntimeConfig
from scheduler.errors import ActorDead, ActorError, RequestTimeout
from scheduler.events import ActorStatus, Pending, ReplyEvent
from scheduler.exchange import TensorExchange
from scheduler.ledger import MemoryLedger
from scheduler.procs import (
    DEAD,
    READY,
    STOPPING,
    ActorProc,
    ZygoteClient,
    bind_router,
    close_sentinel,
    kill_tree,
    sigint_deferred,
    start_actor,
)
from scheduler.pump import EventPump
from scheduler.trace import TraceSink
from shm.arena import ALIGN, Arena, new_run_id, segment_name, sweep_dead_segments
from shm.slots import SlotAllocator
from shm.watchdog import Watchdog

log = logging.getLogger("cadence.scheduler")
_ROLE = re.compile(r"[a-z][a-z0-9_]{0,31}\Z")


LAST_WORD_S = 0.25  # how long a stopped actor's last message may trail the actors' exit


class Runtime(EventPump, TensorExchange):
    def __init__(self, config: RuntimeConfig | None = None, run_id: str | None = None):
        self.config = config or RuntimeConfig()
        self.run_id = run_id or new_run_id()
        self.pid = os.getpid()
        self.t0_ns = time.monotonic_ns()
        self.tracer = Tracer(self.config.trace.enabled)
        self.trace = TraceSink(self.run_id, self.config.trace, self.t0_ns)
        self.trace.name_process(self.pid, "scheduler")
        self.ledger = MemoryLedger(self.config.memory.budget_bytes)
        self.actors: dict[str, ActorProc] = {}
        self.arenas: dict[str, Arena] = {}
        self.events: deque = deque()
        self._listeners: list = []  # add_listener: called with each event as it arrives
        self.trace_path = None
        self.bad_frames = 0  # malformed frames received (each was answered with an Error)
        self._pending: dict[int, Pending] = {}
        self._queued: Counter = Counter()  # role -> requests awaiting a reply (not abandoned)
        self._sentinels: dict[int, str] = {}
        self._next_req = 1
        self._samples_seen = 0
        self._router = self._zctx = self._poller = self._watchdog = None
        self._zygote: ZygoteClient | None = None
        self.run_dir = None
        self._started = self._closed = False

    # -- lifecycle ------------------------------------------------------------------------------

    def __enter__(self) -> "Runtime":
        self.start()
        return self

    def __exit__(self, et, ev, tb) -> bool:
        if et is not None and issubclass(et, KeyboardInterrupt):
            why = "stopped by SIGTERM" if issubclass(et, Terminated) else "interrupted (Ctrl-C)"
            log.warning("cadence: run %s %s; stopping %s", self.run_id, why, ", ".join(self.actors) or "nothing")
        self.shutdown()
        return False

    def start(self) -> None:
        mem = self.config.memory
        self.plan = self.ledger.plan(mem.role_bytes, mem.arena_bytes)  # refuse before creating anything
        sweep_dead_segments()
        set_process_name("cad-scheduler")
        self._started = True
        self.ledger.watch("scheduler", self.pid)
        if mem.sample_s:
            self.ledger.start_sampling(mem.sample_s)
        try:
            self.run_dir = tempfile.mkdtemp(prefix=f"cadence-{self.run_id}-")
            self._watchdog = Watchdog(self.run_id)
            self._watchdog.guard_dir(self.run_dir)
            self._watchdog.guard_segment(segment_name(self.run_id, "main"))
            self.arena = Arena.create(self.run_id, "main", mem.arena_bytes)
            self.arenas[self.arena.name] = self.arena
            stream = mem.stream_bytes // ALIGN * ALIGN
            experts = mem.expert_bytes // ALIGN * ALIGN
            self.stream_slots = SlotAllocator(stream - experts, name="the loader slots", setting="memory.stream_bytes")
            self.expert_slots = SlotAllocator(
                experts, base=stream - experts, name="the expert buffer", setting="memory.expert_bytes"
            )
            self.slots = SlotAllocator(
                self.arena.nbytes - stream,
                base=stream,
                name="the exchange part of the arena",
                setting="memory.arena_bytes",
            )
            self._zctx = zmq.Context()
            self.endpoint = f"ipc://{self.run_dir}/ctl"
            self._router = bind_router(self._zctx, self.endpoint)
            self._poller = zmq.Poller()
            self._poller.register(self._router, zmq.POLLIN)
        except BaseException:
            self.shutdown()
            raise

    def spawn(self, role: str, actor, init: dict | None = None, wait: bool = True) -> ActorProc:
        """Start an actor process. `actor` is an Actor subclass or 'module:Class'; `init` (msgpack-able)
        reaches its `__init__`. With `wait`, returns once it is READY; else call `wait_ready` later
        (spawning several first lets them start in parallel). Spawn from the thread that lives as long
        as the run, normally the main one: the kernel's parent-death signal follows the spawning thread."""
        if not self._started or self._closed:
            raise CadenceError("spawn needs a started scheduler: use `with Runtime(config) as s:`")
        if not _ROLE.match(role):
            raise CadenceError(f"role must be lowercase letters, digits or '_', got {role!r}")
        if role in self.actors and self.actors[role].alive:
            raise CadenceError(f"a {role} actor is already running (pid {self.actors[role].pid})")
        path = actor if isinstance(actor, str) else f"{actor.__module__}:{actor.__qualname__}"
        if path.startswith("__main__:"):
            raise CadenceError(f"actor class {path} must live in an importable module, not in __main__")
        init = dict(init or {})
        try:
            wire.encode(wire.Init(init, [], 0, 0.0, False))
        except wire.WireError as e:
            raise CadenceError(f"the init for the {role} actor cannot be sent: {e}") from None
        t = self.config.timeouts
        proc = start_actor(
            role, path, init, self.endpoint, init_wait_s=t.hello_s + t.init_s, zygote=self._zygote_for_spawn()
        )
        proc.deadline = time.monotonic() + t.hello_s
        self.actors[role] = proc
        self.trace.name_process(proc.pid, role)  # processes appear in spawn order
        self._sentinels[proc.sentinel] = role
        self._poller.register(proc.sentinel, zmq.POLLIN)
        if wait:
            self.wait_ready([role])
        return proc

    @property
    def zygote_pid(self) -> int | None:
        """The zygote the actors fork from (None until the first spawn, or when actors start as interpreters)."""
        return self._zygote.proc.pid if self._zygote is not None else None

    def _zygote_for_spawn(self) -> ZygoteClient | None:
        """The zygote actors fork from, started on the first spawn (and again if it died since)."""
        if not self.config.fork_actors or not hasattr(os, "fork"):
            return None
        if self._zygote is not None and not self._zygote.alive:
            self._zygote.close()
            self._zygote = None
        if self._zygote is None:
            self._zygote = ZygoteClient(self.config.timeouts.hello_s, tuple(self.config.preload))
        return self._zygote

    def wait_ready(self, roles: list[str] | None = None, timeout: float | None = None) -> None:
        """Until every named actor (default: all) is READY; ActorDead if one dies or misses a step."""
        roles = roles or list(self.actors)
        limit = timeout if timeout is not None else self.config.timeouts.ready_s
        deadline = time.monotonic() + limit
        while True:
            for r in roles:
                if self.actors[r].state == DEAD:
                    raise ActorDead(r, self.actors[r].reason)
            waiting = [r for r in roles if self.actors[r].state != READY]
            if not waiting:
                return
            if time.monotonic() > deadline:
                raise CadenceError(
                    f"the {', '.join(waiting)} actor(s) were not READY within {limit:g} s (raise timeouts.ready_s)"
                )
            self._pump(0.05)

    def shutdown(self) -> None:
        """Ask every actor to stop, wait up to timeouts.shutdown_s, kill what is left, clean up."""
        if self._closed:
            return
        self._closed = True
        with sigint_deferred():
            try:
                if self._poller is not None:
                    self._stop_actors()
            finally:
                self._release()

    def _stop_actors(self) -> None:
        live = [p for p in self.actors.values() if p.popen.poll() is None]
        for p in live:
            if p.state != DEAD:
                p.state = STOPPING
            try:
                self._send_frames(p.role, wire.encode(wire.Stop("shutdown")))
            except (zmq.ZMQError, ActorDead):
                pass
        deadline = time.monotonic() + self.config.timeouts.shutdown_s
        while any(p.popen.poll() is None for p in live) and time.monotonic() < deadline:
            self._pump(0.02)
        # a process can exit before what it sent last reaches this socket: read on until each said its last
        # word (a stopping actor's last message, after its last trace batch); one that died says none
        grace = time.monotonic() + LAST_WORD_S
        while any(p.said is None for p in live) and time.monotonic() < grace:
            self._pump(0.02)
        for p in live:
            if p.popen.poll() is None:
                log.warning(
                    "cadence: the %s actor did not stop within %g s (timeouts.shutdown_s); killing it",
                    p.role,
                    self.config.timeouts.shutdown_s,
                )
                kill_tree(p.popen, timeout=0.5)
        self._pump(0)
        for p in self.actors.values():
            if p.state != DEAD:
                p.state, p.reason = DEAD, "was stopped"

    def _release(self) -> None:
        steps = [
            self.ledger.stop_sampling,
            lambda: self._router is not None and self._router.close(linger=0),
            lambda: self._zctx is not None and self._zctx.term(),
            *[lambda p=p: close_sentinel(p) for p in self.actors.values()],
            *[lambda a=a: (a.close(), a.unlink()) for a in self.arenas.values()],
            lambda: self.run_dir and shutil.rmtree(self.run_dir, ignore_errors=True),
            lambda: self._zygote is not None and self._zygote.close(),
            lambda: self._watchdog is not None and self._watchdog.close(),
            self._write_trace,
        ]
        for step in steps:
            try:
                step()
            except Exception:
                log.exception("cadence: cleanup step failed (the watchdog and the next run's sweep cover it)")

    def _write_trace(self) -> None:
        self.trace.add(self.pid, self.tracer.drain())
        self.trace_path = self.trace.write()
        if self.trace_path:
            log.info("cadence: trace written to %s", self.trace_path)

    # -- requests ---------------------------------------------------------------------------------

    def send(
        self, role: str, op: str | Payload, args: dict | None = None, tensors: dict | None = None, lease: bool = True
    ) -> int:
        """Queue a request; returns its id. `op` is the op's name and `args` its map, or a payload
        (actors/ops.py) that is both. With `lease`, every slot a descriptor points into is leased to
        `role` until its reply (or death), so it cannot be reused while being read."""
        if isinstance(op, Payload):
            op, args = op.op, op.wire()
        proc = self._live(role)
        req_id = self._next_req
        self._next_req += 1
        wire_tensors, leases = self._wire_tensors(role, tensors or {}, lease)
        flow = req_id if self.tracer.enabled else None
        try:
            with self.tracer.span(f"send {op}", cat="scheduler", args={"to": role, "req": req_id}, flow_out=flow):
                self._send_frames(proc.role, wire.encode(wire.Request(op, args or {}, wire_tensors, req_id, flow)))
        except BaseException:
            for alloc, slot in leases:
                alloc.release(slot, role)
            raise
        self._pending[req_id] = Pending(role, op, leases, sent=time.monotonic())
        self._count_queue(role, +1)
        return req_id

    def call(
        self,
        role: str,
        op: str | Payload,
        args: dict | None = None,
        tensors: dict | None = None,
        timeout: float | None = None,
    ) -> wire.Reply:
        """Send and wait for the reply. ActorError if the op failed, ActorDead, RequestTimeout."""
        if isinstance(op, Payload):
            op, args = op.op, op.wire()
        limit = timeout if timeout is not None else self.config.timeouts.request_s
        with self.tracer.span(f"call {op}", cat="scheduler", args={"to": role}):
            req_id = self.send(role, op, args, tensors)
            deadline = time.monotonic() + limit
            while True:
                reply = self._pop_reply(req_id)
                if reply is not None:
                    if not reply.ok:
                        raise ActorError(role, op, req_id, reply.error)
                    return reply
                proc = self.actors[role]
                if proc.state == DEAD:
                    raise ActorDead(role, proc.reason)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self._abandon(req_id)
                    raise RequestTimeout(role, op, req_id, limit)
                self._pump(min(remaining, 0.1))

    def take_reply(self, req_id: int) -> wire.Reply | None:
        """The reply to `req_id` if it has arrived and nobody has taken it (then it is removed)."""
        self._pump(0)
        return self._pop_reply(req_id)

    def _pop_reply(self, req_id: int) -> wire.Reply | None:
        for ev in self.events:
            if isinstance(ev, ReplyEvent) and ev.reply.req_id == req_id:
                self.events.remove(ev)
                return ev.reply
        return None

    def poll(self, timeout: float = 0.0) -> list:
        """Everything that happened: ReplyEvent, DeadEvent, ErrorEvent. Waits up to `timeout` for one."""
        deadline = time.monotonic() + timeout
        self._pump(0)
        while not self.events:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            self._pump(min(remaining, 0.1))
        out = list(self.events)
        self.events.clear()
        return out

    def pending(self, role: str | None = None) -> int:
        """Requests awaiting a reply, to `role` or to anyone."""
        return self._queued[role] if role is not None else sum(self._queued.values())

    def add_listener(self, fn) -> None:
        """Call `fn(event)` for every ReplyEvent, DeadEvent and ErrorEvent as the loop receives it,
        before `poll`/`call` hand it out: the monitor's feed. It runs inside the loop, so it must
        be quick; one that raises is logged and removed."""
        self._listeners.append(fn)

    def remove_listener(self, fn) -> None:
        if fn in self._listeners:
            self._listeners.remove(fn)

    def actor_status(self) -> list[ActorStatus]:
        """Each actor's pid, handshake state and current op (its oldest unanswered request).
        Cheap, and safe to call from another thread: it reads copies of the tables."""
        oldest: dict[str, tuple[int, Pending]] = {}
        for req_id, p in list(self._pending.items()):
            if p.role not in oldest or req_id < oldest[p.role][0]:
                oldest[p.role] = (req_id, p)
        out = []
        for role, proc in list(self.actors.items()):
            p = oldest.get(role, (0, None))[1]
            out.append(
                ActorStatus(role, proc.pid, proc.state, p.op if p else None, p.sent if p else None, self._queued[role])
            )
        return out

    def send_raw(self, role: str, frames: list[bytes]) -> None:
        """Any frames at all to an actor (tests, tools): it must answer, not die."""
        self._send_frames(self._live(role).role, frames)
