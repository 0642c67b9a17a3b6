"""Actor processes seen from the scheduler: start one, watch its deadlines, explain its death, kill its tree."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import psutil
import zmq

from scheduler.config import Timeouts
from shm.watchdog import python_env

# handshake states, in order
STARTING, INITIALIZING, READY, STOPPING, DEAD = "starting", "initializing", "ready", "stopping", "dead"


@dataclass
class ActorProc:
    role: str
    cls_path: str
    init: dict
    popen: subprocess.Popen
    sentinel: int  # a pidfd: readable once the process has exited
    state: str = STARTING
    deadline: float = 0.0  # of the current handshake step
    last_seen: float = field(default_factory=time.monotonic)
    actor: str = ""  # class name, from READY
    ops: list = field(default_factory=list)
    said: str | None = None  # reason from a DEAD frame, if one came
    reason: str | None = None  # final reason once DEAD

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def alive(self) -> bool:
        return self.state != DEAD

    def overdue(self, now: float, t: Timeouts) -> str | None:
        """Why this actor has missed a deadline (a handshake step, its heartbeat), or None."""
        if self.state == STARTING and now > self.deadline:
            return f"did not send HELLO within {t.hello_s:g} s (raise timeouts.hello_s)"
        if self.state == INITIALIZING and now > self.deadline:
            return f"did not answer INIT within {t.init_s:g} s (raise timeouts.init_s)"
        if self.state == READY and now - self.last_seen > t.heartbeat_s:
            return (f"sent nothing for {t.heartbeat_s:g} s, so it was killed as hung "
                    f"(raise timeouts.heartbeat_s if its steps take that long)")
        return None


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


def start_actor(role: str, cls_path: str, init: dict, endpoint: str, init_wait_s: float) -> ActorProc:
    """Start `python -m actors <spec>`. stdout/stderr are inherited: actor logs land with ours."""
    spec = {"role": role, "cls": cls_path, "endpoint": endpoint, "parent_pid": os.getpid(), "init_wait_s": init_wait_s}
    popen = subprocess.Popen([sys.executable, "-m", "actors", json.dumps(spec)],
                             stdin=subprocess.DEVNULL, close_fds=True, env=python_env())
    try:
        sentinel = os.pidfd_open(popen.pid)
    except OSError:
        popen.kill()
        popen.wait()
        raise
    return ActorProc(role, cls_path, init, popen, sentinel)


def exit_reason(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name}"
    return f"exited with code {returncode}"


def kill_tree(popen: subprocess.Popen, timeout: float = 1.0) -> None:
    """SIGKILL an actor and all its descendants, then reap it."""
    if popen.poll() is not None:
        return  # reaped already: its pid may belong to someone else now
    try:
        # collect the children first: once the actor dies they are re-parented and out of reach
        children = psutil.Process(popen.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
    for p in children:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    if popen.poll() is None:
        popen.kill()
    try:
        popen.wait(timeout)
    except subprocess.TimeoutExpired:
        pass  # unkillable (D state); the kernel finishes it
    psutil.wait_procs(children, timeout=timeout)


@contextmanager
def sigint_deferred():
    """During cleanup a second Ctrl-C must not cut it short (only the main thread owns signals)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGINT, lambda s, f: None)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def close_sentinel(proc: ActorProc) -> None:
    if proc.sentinel >= 0:
        os.close(proc.sentinel)
        proc.sentinel = -1
