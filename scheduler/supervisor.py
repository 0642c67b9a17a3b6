"""The actor processes under the scheduler: started (forked from the zygote, or as interpreters), watched
through their handshake, heartbeats and exits, stopped and killed.

`Supervisor` owns the table of `ActorProc`s (procs.py), their sentinels and the zygote, and alone writes
them. The message pump (pump.py) reads the table and tells the supervisor what it heard: a frame from an
actor (`heard`), a handshake step (`hello`, `ready`), its last word (`last_word`), an exit (`reap`), a
death (`mark_dead`); it asks which deadlines passed (`overdue`) and has those actors killed (`kill`).
At the end `stop_all` has each actor told STOP and the pump's loop turn, through the two callables it gets.
The supervisor knows no socket and no request.
"""

from __future__ import annotations

import logging
import os
import re
import time
from typing import Callable

from actors import wire
from common.errors import CadenceError
from scheduler.errors import ActorDead
from scheduler.ledger import MemoryLedger
from scheduler.procs import (
    DEAD,
    INITIALIZING,
    READY,
    STOPPING,
    ActorProc,
    ZygoteClient,
    close_sentinel,
    exit_reason,
    kill_tree,
    start_actor,
)
from scheduler.runtime_config import RuntimeConfig
from scheduler.trace import TraceSink

log = logging.getLogger("cadence.scheduler")
_ROLE = re.compile(r"[a-z][a-z0-9_]{0,31}\Z")

LAST_WORD_S = 0.25  # how long a stopped actor's last message may trail the actors' exit


class Supervisor:
    """The actors' processes: spawn, handshake and heartbeat deadlines, exits, stop. It names each process
    in the trace and has the ledger watch each one while it is READY."""

    def __init__(self, config: RuntimeConfig, ledger: MemoryLedger, trace: TraceSink):
        self.timeouts = config.timeouts
        self.fork_actors = config.fork_actors
        self.preload = tuple(config.preload)
        self.ledger = ledger
        self.trace = trace
        self.actors: dict[str, ActorProc] = {}
        self._sentinels: dict[int, ActorProc] = {}  # pidfd -> its actor, until reaped
        self._zygote: ZygoteClient | None = None

    # -- start ----------------------------------------------------------------------------------

    def spawn(self, role: str, actor, init: dict | None, endpoint: str) -> ActorProc:
        """Start the process of the `role` actor (`actor`: an Actor subclass or 'module:Class'), which will
        connect to `endpoint` and say HELLO within timeouts.hello_s. Watch its sentinel (`sentinel_of`)."""
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
        t = self.timeouts
        proc = start_actor(
            role, path, init, endpoint, init_wait_s=t.hello_s + t.init_s, zygote=self._zygote_for_spawn()
        )
        proc.deadline = time.monotonic() + t.hello_s
        self.actors[role] = proc
        self.trace.name_process(proc.pid, role)  # processes appear in spawn order
        self._sentinels[proc.sentinel] = proc
        return proc

    @property
    def zygote_pid(self) -> int | None:
        """The zygote the actors fork from (None until the first spawn, or when actors start as interpreters)."""
        return self._zygote.proc.pid if self._zygote is not None else None

    def _zygote_for_spawn(self) -> ZygoteClient | None:
        """The zygote actors fork from, started on the first spawn (and again if it died since)."""
        if not self.fork_actors or not hasattr(os, "fork"):
            return None
        if self._zygote is not None and not self._zygote.alive:
            self._zygote.close()
            self._zygote = None
        if self._zygote is None:
            self._zygote = ZygoteClient(self.timeouts.hello_s, self.preload)
        return self._zygote

    # -- what the pump heard --------------------------------------------------------------------

    def live(self, role: str) -> ActorProc:
        """The `role` actor, READY for requests; else why not (ActorDead, or a CadenceError naming the fix)."""
        proc = self.actors.get(role)
        if proc is None:
            raise CadenceError(f"there is no {role} actor; spawn it first")
        if proc.state == DEAD:
            raise ActorDead(role, proc.reason)
        if proc.state != READY:
            raise CadenceError(f"the {role} actor is not READY yet ({proc.state}); call wait_ready first")
        return proc

    def heard(self, proc: ActorProc) -> None:
        """A frame came from the actor: it is not hung."""
        proc.last_seen = time.monotonic()

    def hello(self, proc: ActorProc) -> None:
        """HELLO came (in state STARTING): INIT goes out, READY is due within timeouts.init_s."""
        proc.state, proc.deadline = INITIALIZING, time.monotonic() + self.timeouts.init_s

    def ready(self, proc: ActorProc, actor: str, ops: list) -> None:
        """READY came (in state INITIALIZING), from an instance of class `actor` that serves `ops`."""
        proc.state, proc.actor, proc.ops = READY, actor, ops
        self.ledger.watch(proc.role, proc.pid)
        self.trace.name_process(proc.pid, f"{proc.role} ({actor})")

    def last_word(self, proc: ActorProc, reason: str) -> bool:
        """A DEAD frame came: the actor's own reason. True if that is a death to report (it was not stopping)."""
        proc.said = reason
        return proc.state not in (STOPPING, DEAD)

    def mark_dead(self, proc: ActorProc, reason: str) -> None:
        proc.state, proc.reason = DEAD, reason
        self.ledger.unwatch(proc.role)
        log.error("cadence: the %s actor %s", proc.role, reason)

    def sentinel_of(self, fd) -> ActorProc | None:
        """The actor whose sentinel (a pidfd, readable once it exited) `fd` is, while it is not reaped."""
        return self._sentinels.get(fd)

    def reap(self, proc: ActorProc) -> str | None:
        """Its sentinel said the actor exited (stop polling the sentinel first): reap it. Why it died,
        if that is news to report; None if it was stopped or its death is known already."""
        self._sentinels.pop(proc.sentinel, None)
        close_sentinel(proc)
        rc = proc.popen.wait()  # the pidfd said it exited: this only reaps
        if proc.state == STOPPING:
            proc.state, proc.reason = DEAD, "was stopped"
        elif proc.state != DEAD:
            return proc.said or exit_reason(rc)
        return None

    def overdue(self) -> list[tuple[ActorProc, str]]:
        """The actors that missed a deadline (a handshake step, their heartbeat), and why: kill them."""
        now = time.monotonic()
        return [(proc, reason) for proc in self.actors.values() if (reason := proc.overdue(now, self.timeouts))]

    def kill(self, proc: ActorProc) -> None:
        """SIGKILL the actor's process tree (then `mark_dead` it)."""
        kill_tree(proc.popen, timeout=0.5)

    # -- stop -----------------------------------------------------------------------------------

    def stop_all(self, tell_stop: Callable[[ActorProc], None], turn: Callable[[float], None]) -> None:
        """Ask every running actor to stop (`tell_stop`), let the loop run (`turn(seconds)`) until they
        exit or timeouts.shutdown_s passes, and until each said its last word; kill what is left."""
        live = [p for p in self.actors.values() if p.popen.poll() is None]
        for p in live:
            if p.state != DEAD:
                p.state = STOPPING
            tell_stop(p)
        deadline = time.monotonic() + self.timeouts.shutdown_s
        while any(p.popen.poll() is None for p in live) and time.monotonic() < deadline:
            turn(0.02)
        # a process can exit before what it sent last reaches the socket: read on until each said its last
        # word (a stopping actor's last message, after its last trace batch); one that died says none
        grace = time.monotonic() + LAST_WORD_S
        while any(p.said is None for p in live) and time.monotonic() < grace:
            turn(0.02)
        for p in live:
            if p.popen.poll() is None:
                log.warning(
                    "cadence: the %s actor did not stop within %g s (timeouts.shutdown_s); killing it",
                    p.role,
                    self.timeouts.shutdown_s,
                )
                kill_tree(p.popen, timeout=0.5)
        turn(0)
        for p in self.actors.values():
            if p.state != DEAD:
                p.state, p.reason = DEAD, "was stopped"

    def close_sentinels(self) -> None:
        for p in self.actors.values():
            close_sentinel(p)

    def close_zygote(self) -> None:
        if self._zygote is not None:
            self._zygote.close()
