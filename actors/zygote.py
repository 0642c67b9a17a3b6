"""`python -m actors.zygote FD_IN FD_OUT [MODULE...]`: imports the actors' code once, then forks every actor.

Model processes that each import torch hold a copy of its pages each; one process that imports torch and
forks them holds them once, because the children share its pages copy-on-write (BENCHMARKS.md, "The lean
runtime under 1.0 and 0.75 GiB"). So the scheduler (which never imports torch) starts this one
process, which imports the MODULEs it is given (torch, the kernels and the model code, loaded
once, into the shared pages), then asks it for each actor in turn, one JSON line per request:

    {"spec": <actor_main's spec>}          ->  "<pid>\\n" on FD_OUT    (or "error <text>\\n")

An actor whose class lives in another module imports it itself, after the fork, before its HELLO
(as a directly started actor would). Each request forks twice: the middle process exits at once,
so the actor is re-parented to the scheduler, which made itself a child subreaper. The actor is
then the scheduler's own child, as if started directly: it can be waited for, its exit code read,
and its parent-death signal tied to the scheduler, not to this process.

Forking is only safe before any thread pool exists: nothing here runs a torch op, and each actor
sets its thread count after the fork.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import signal
import sys
import time

from common.procname import set_process_name

REPARENT_WAIT_S = 5.0


def preload(modules: list[str]) -> None:
    """Import the actors' modules (and load the CPU kernels if they use them) into the shared pages; an entry
    `vocabulary:DIR:ROWS` makes a grammar's view of that vocabulary there too (speculative/grammar.py `PRELOAD`)."""
    for name in modules:
        try:
            if name.startswith("vocabulary:"):
                importlib.import_module("speculative.grammar").preload(name)
                continue
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the actor's own import reports it, as a DEAD frame
            pass
    if "models.kernels" in sys.modules:
        sys.modules["models.kernels"].available()
    gc.collect()
    gc.freeze()  # a collection in an actor must not touch (and so copy) the pages of every shared object


def _become_actor(spec: dict, fds: tuple[int, ...]) -> None:
    """In the grandchild: wait to be the scheduler's child, then run the actor and exit."""
    for fd in fds:
        os.close(fd)
    deadline = time.monotonic() + REPARENT_WAIT_S
    while os.getppid() != spec["parent_pid"] and time.monotonic() < deadline:
        time.sleep(0.001)
    code = 70
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        from actors.base import actor_main

        code = actor_main(spec)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def fork_actor(spec: dict, fds: tuple[int, ...]) -> int:
    """Fork twice; the grandchild becomes the actor. Returns its pid."""
    r, w = os.pipe()
    middle = os.fork()
    if middle == 0:
        try:
            os.close(r)
            pid = os.fork()
            if pid == 0:
                os.close(w)
                _become_actor(spec, fds)
            os.write(w, str(pid).encode())
        finally:
            os._exit(0)
    os.close(w)
    try:
        data = b""
        while chunk := os.read(r, 64):
            data += chunk
    finally:
        os.close(r)
        os.waitpid(middle, 0)  # once it is reaped, the actor has its new parent
    if not data:
        raise OSError("the intermediate process died before it forked the actor")
    return int(data)


def main(fd_in: int, fd_out: int, modules: list[str]) -> int:
    set_process_name("cad-zygote")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the scheduler handles Ctrl-C and closes our pipe
    preload(modules)
    reader = os.fdopen(fd_in, "r")
    for line in reader:
        try:
            spec = json.loads(line)["spec"]
            reply = str(fork_actor(spec, (fd_in, fd_out)))
        except Exception as e:  # noqa: BLE001 - told to the scheduler, which raises it as one sentence
            reply = f"error {type(e).__name__}: {e}"
        try:
            os.write(fd_out, (reply + "\n").encode())
        except BrokenPipeError:  # the scheduler stopped (Ctrl-C, SIGTERM) while we forked: a normal stop
            break
    return 0


if __name__ == "__main__":
    # No lifeline thread here (a fork must find one thread): the scheduler's death closes FD_IN,
    # which ends the loop above, and the kernel's parent-death signal covers a hang.
    import ctypes

    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]))
