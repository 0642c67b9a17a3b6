"""Actor processes seen from the scheduler: start one (as an interpreter, or forked by the zygote through
`ZygoteClient`), tell when it missed a deadline, explain its death, kill its tree. The `Supervisor`
(supervisor.py) keeps the table of them."""

from __future__ import annotations

import ctypes
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import psutil

from scheduler.runtime_config import Timeouts
from shm.watchdog import python_env

# OpenMP's idle threads spin this many turns for the next parallel region before they sleep. libgomp's
# default (300000 turns, milliseconds) let the actor that had just answered keep a core while the other one
# computed, which slowed every verification in the actors; 10000 turns (~0.2 ms) is still longer than the
# gaps inside a forward (BENCHMARKS.md, "The actor runtime's idle OpenMP threads"). Where the user set
# OpenMP's waiting, theirs stands.
SPIN_TURNS = "10000"


def actor_env() -> dict[str, str]:
    """The environment of the actors (and of the zygote that forks them)."""
    env = python_env()
    if "OMP_WAIT_POLICY" not in env:
        env.setdefault("GOMP_SPINCOUNT", SPIN_TURNS)
    return env


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
            return (
                f"sent nothing for {t.heartbeat_s:g} s, so it was killed as hung "
                f"(raise timeouts.heartbeat_s if its steps take that long)"
            )
        return None


def start_actor(
    role: str, cls_path: str, init: dict, endpoint: str, init_wait_s: float, zygote: "ZygoteClient | None" = None
) -> ActorProc:
    """Fork the actor from `zygote`, or start `python -m actors <spec>` (a fresh interpreter, which
    imports everything again). stdout/stderr are inherited: actor logs land with ours."""
    spec = {"role": role, "cls": cls_path, "endpoint": endpoint, "parent_pid": os.getpid(), "init_wait_s": init_wait_s}
    if zygote is not None:
        popen = zygote.fork(spec)
    else:
        popen = subprocess.Popen(
            [sys.executable, "-m", "actors", json.dumps(spec)],
            stdin=subprocess.DEVNULL,
            close_fds=True,
            env=actor_env(),
            start_new_session=True,
        )  # as the zygote's (below)
    try:
        sentinel = os.pidfd_open(popen.pid)
    except OSError:
        popen.kill()
        popen.wait()
        raise
    return ActorProc(role, cls_path, init, popen, sentinel)


class ForkedActor:
    """The part of `subprocess.Popen` the scheduler uses, for an actor the zygote forked (and the
    kernel re-parented to us: we are its parent, so waitpid works as for any child)."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: it is gone, how is unknown
                self.returncode = -signal.SIGKILL
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"actor pid {self.pid}", timeout)
            time.sleep(0.005)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


_PR_SET_CHILD_SUBREAPER = 36


class ZygoteClient:
    """The scheduler's side of `actors.zygote`: one process that has imported the actors' code, which
    forks each actor on request. Started on the first spawn; it holds no lease and no socket, so its
    death only means that the next spawn starts a new one."""

    def __init__(self, timeout_s: float, preload: tuple[str, ...] = ()):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:  # forked actors are re-parented to us
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")
        self.timeout_s = timeout_s
        to_z, self._w = os.pipe()
        self._r, from_z = os.pipe()
        try:
            # a session of its own, as the watchdog's: Ctrl-C reaches the terminal's foreground group, and one
            # that lands while this interpreter starts (before it ignores SIGINT) would print a fatal error;
            # the scheduler handles Ctrl-C and closes our pipe, and the actors forked from here ignore it too
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "actors.zygote", str(to_z), str(from_z), *preload],
                pass_fds=(to_z, from_z),
                stdin=subprocess.DEVNULL,
                env=actor_env(),
                start_new_session=True,
            )
        finally:
            os.close(to_z)
            os.close(from_z)
        self._buf = b""

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def fork(self, spec: dict) -> ForkedActor:
        from common.errors import CadenceError

        try:
            os.write(self._w, (json.dumps({"spec": spec}) + "\n").encode())
        except BrokenPipeError:
            raise CadenceError(
                f"the zygote process {exit_reason(self.proc.wait())} before it could start the {spec['role']} actor"
            ) from None
        deadline = time.monotonic() + self.timeout_s
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self._r], [], [], max(left, 0))
            if not ready:
                raise CadenceError(
                    f"the zygote process did not start the {spec['role']} actor within "
                    f"{self.timeout_s:g} s (raise timeouts.hello_s)"
                )
            chunk = os.read(self._r, 4096)
            if not chunk:
                raise CadenceError(
                    f"the zygote process {exit_reason(self.proc.wait())} while starting the {spec['role']} actor"
                )
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        text = line.decode()
        if text.startswith("error "):
            raise CadenceError(f"the zygote process could not start the {spec['role']} actor: {text[6:]}")
        return ForkedActor(int(text))

    def close(self, timeout: float = 2.0) -> None:
        for fd in (self._w, self._r):
            if fd >= 0:
                os.close(fd)
        self._w = self._r = -1
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


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
    """During cleanup a second Ctrl-C (or a SIGTERM) must not cut it short (only the main thread owns signals)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {sig: signal.signal(sig, lambda s, f: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def close_sentinel(proc: ActorProc) -> None:
    if proc.sentinel >= 0:
        os.close(proc.sentinel)
        proc.sentinel = -1
