"""The actor runtime of the scheduler process: it owns the run (arena, sockets, actor processes, trace),
supervises the actors and relays requests to them and their replies back. What to ask of whom, and
when, is decided above it (scheduler/generation/: the speculation cycle's sides, the layer streamer,
the expert buffer).

    with Runtime(config) as s:                      # plan memory, sweep, arena, ROUTER, watchdog
        s.spawn("verifier", "actors.verifier:VerifierActor", {...})  # HELLO -> INIT -> READY, each step timed
        reply = s.call("verifier", "layer", {"group": "layer.3"}, {"slot": desc})   # an op by name (actors/calls.py)
        rid = s.send("loader", "load", {"group": "layer.4"}, ...); events = s.poll(0.1)   # replies, deaths, errors
    # exit: STOP, join to timeouts.shutdown_s, kill the trees, unlink, write traces/<run-id>.json

`Runtime` composes three parts, each with its own state: the `Supervisor` (supervisor.py: the actor
processes, their zygote, handshakes, heartbeats, exits and stop), the `MessagePump` (pump.py: the ROUTER
socket, the requests in flight, the events) and the `TensorExchange` (exchange.py: the arena and its
slots). Deaths are seen two ways: a DEAD frame (the actor's own last word) and the process sentinel (a
pidfd in the pump's poller), so a SIGKILLed actor is noticed at once. Either way the caller gets one
`ActorDead(role, reason)`. A watchdog process unlinks everything if we die instead.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time

import zmq

from actors import wire
from actors.tracing import Tracer
from common.errors import CadenceError, Terminated
from common.procname import set_process_name
from scheduler.errors import ActorDead
from scheduler.events import ActorStatus
from scheduler.exchange import TensorExchange
from scheduler.ledger import MemoryLedger
from scheduler.procs import DEAD, READY, ActorProc, sigint_deferred
from scheduler.pump import MessagePump
from scheduler.runtime_config import RuntimeConfig
from scheduler.supervisor import Supervisor
from scheduler.trace import LEFT_BEHIND, TraceSink
from shm.arena import new_run_id, segment_name, sweep_dead, sweep_dead_segments
from shm.watchdog import Watchdog

log = logging.getLogger("cadence.scheduler")


class Runtime:
    def __init__(self, config: RuntimeConfig | None = None, run_id: str | None = None):
        self.config = config or RuntimeConfig()
        self.run_id = run_id or new_run_id()
        self.pid = os.getpid()
        self.t0_ns = time.monotonic_ns()
        self.tracer = Tracer(self.config.trace.enabled)
        self.trace = TraceSink(self.run_id, self.config.trace, self.t0_ns)
        self.trace.name_process(self.pid, "scheduler")
        self.ledger = MemoryLedger(self.config.memory.budget_bytes)
        self.supervisor = Supervisor(self.config, self.ledger, self.trace)
        self.pump = MessagePump(
            self.supervisor,
            timeouts=self.config.timeouts,
            tracer=self.tracer,
            trace=self.trace,
            ledger=self.ledger,
            pid=self.pid,
            t0_ns=self.t0_ns,
        )
        self.exchange: TensorExchange | None = None  # once started
        self.trace_path = None
        self.run_dir = self.endpoint = None
        self._watchdog: Watchdog | None = None
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
        if self.config.trace.enabled and self.config.trace.path.is_dir():
            sweep_dead(self.config.trace.path, LEFT_BEHIND, 1)  # what a trace cut short by SIGKILL left
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
            self.exchange = TensorExchange(self.run_id, mem)
            self.endpoint = f"ipc://{self.run_dir}/ctl"
            self.pump.open(self.endpoint, self.exchange)
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
        proc = self.supervisor.spawn(role, actor, init, self.endpoint)
        self.pump.watch(proc.sentinel)
        if wait:
            self.wait_ready([role])
        return proc

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
            self.pump.turn(0.05)

    def shutdown(self) -> None:
        """Ask every actor to stop, wait up to timeouts.shutdown_s, kill what is left, clean up."""
        if self._closed:
            return
        self._closed = True
        with sigint_deferred():
            try:
                if self.pump.opened:
                    self.supervisor.stop_all(self._tell_stop, self.pump.turn)
            finally:
                self._release()

    def _tell_stop(self, proc: ActorProc) -> None:
        try:
            self.pump.tell(proc.role, wire.Stop("shutdown"))
        except (zmq.ZMQError, ActorDead):
            pass

    def _release(self) -> None:
        steps = [
            self.ledger.stop_sampling,
            self.pump.close,
            self.supervisor.close_sentinels,
            lambda: self.exchange is not None and self.exchange.close(),
            lambda: self.run_dir and shutil.rmtree(self.run_dir, ignore_errors=True),
            self.supervisor.close_zygote,
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

    # -- the processes --------------------------------------------------------------------------

    @property
    def actors(self) -> dict[str, ActorProc]:
        """Role -> its process, as the supervisor sees it (read only)."""
        return self.supervisor.actors

    @property
    def zygote_pid(self) -> int | None:
        """The zygote the actors fork from (None until the first spawn, or when actors start as interpreters)."""
        return self.supervisor.zygote_pid

    @property
    def watchdog_pid(self) -> int | None:
        """The watchdog process that unlinks the run's shared memory if this process dies (None until started)."""
        return self._watchdog.proc.pid if self._watchdog is not None else None

    def actor_status(self) -> list[ActorStatus]:
        """Each actor's pid, handshake state and current op (its oldest unanswered request).
        Cheap, and safe to call from another thread: it reads copies of the tables."""
        current = self.pump.current()
        out = []
        for role, proc in list(self.actors.items()):
            p = current.get(role)
            out.append(
                ActorStatus(
                    role, proc.pid, proc.state, p.op if p else None, p.sent if p else None, self.pump.pending(role)
                )
            )
        return out

    # -- requests -------------------------------------------------------------------------------

    def send(
        self, role: str, op: str, args: dict | None = None, tensors: dict | None = None, lease: bool = True
    ) -> int:
        """Queue a request; returns its id. `op` is the op's name and `args` its arguments (scheduler/remote.py
        `Remote` calls an actor's ops as methods). With `lease`, every slot a descriptor points into is leased to
        `role` until its reply (or death), so it cannot be reused while being read."""
        return self.pump.send(role, op, args or {}, tensors or {}, lease)

    def call(
        self,
        role: str,
        op: str,
        args: dict | None = None,
        tensors: dict | None = None,
        timeout: float | None = None,
    ) -> wire.Reply:
        """Send and wait for the reply. ActorError if the op failed, ActorDead, RequestTimeout."""
        limit = timeout if timeout is not None else self.config.timeouts.request_s
        with self.tracer.span(f"call {op}", cat="scheduler", args={"to": role}):
            req_id = self.send(role, op, args, tensors)
            return self.pump.wait_reply(role, op, req_id, limit)

    def take_reply(self, req_id: int) -> wire.Reply | None:
        """The reply to `req_id` if it has arrived and nobody has taken it (then it is removed)."""
        return self.pump.take_reply(req_id)

    def poll(self, timeout: float = 0.0) -> list:
        """Everything that happened: ReplyEvent, DeadEvent, ErrorEvent. Waits up to `timeout` for one."""
        return self.pump.poll(timeout)

    def pending(self, role: str | None = None) -> int:
        """Requests awaiting a reply, to `role` or to anyone."""
        return self.pump.pending(role)

    def add_listener(self, fn) -> None:
        """Call `fn(event)` for every ReplyEvent, DeadEvent and ErrorEvent as the loop receives it,
        before `poll`/`call` hand it out: the monitor's feed. It runs inside the loop, so it must
        be quick; one that raises is logged and removed."""
        self.pump.add_listener(fn)

    def remove_listener(self, fn) -> None:
        self.pump.remove_listener(fn)

    def send_raw(self, role: str, frames: list[bytes]) -> None:
        """Any frames at all to an actor (tests, tools): it must answer, not die."""
        self.pump.send_raw(role, frames)

    # -- tensors --------------------------------------------------------------------------------

    @property
    def arena(self):
        return self.exchange.arena

    @property
    def slots(self):
        """The exchange slots: tensors in requests."""
        return self.exchange.slots

    @property
    def stream_slots(self):
        """The loader's slots: streamed weights."""
        return self.exchange.stream_slots

    @property
    def expert_slots(self):
        """A mixture of experts' expert buffer."""
        return self.exchange.expert_slots

    def slot_desc(self, slot):
        return self.exchange.slot_desc(slot)

    def put(self, tensor):
        return self.exchange.put(tensor)

    def view(self, value):
        return self.exchange.view(value)
