"""A tiny process that cleans up after a scheduler that died without cleaning up (SIGKILL, OOM).

The scheduler starts it first, holds the write end of a pipe to it and tells it, one line at a
time, each segment and directory it creates. When the pipe reaches end of file (the scheduler
exited, however it exited) the watchdog unlinks them all. If the scheduler did not say "bye"
first, it prints one line saying the scheduler died. It runs in its own session, so a Ctrl-C
meant for the run does not stop it before it has cleaned up. Imports nothing heavy: `python -m
shm.watchdog` starts in tens of milliseconds.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

from common.procname import set_process_name
from shm.arena import SEGMENT_NAME, SHM_DIR

PROCESS_NAME = "cad-watchdog"  # what ps shows (and bench/cgroup.py `kill_all` spares, so that it cleans up)
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def python_env() -> dict[str, str]:
    """The environment for our child interpreters: this checkout importable, installed or not."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH")) if p)
    return env


class Watchdog:
    """The scheduler's side: start the watchdog, then `guard_*` everything created."""

    def __init__(self, run_id: str, scheduler_pid: int | None = None):
        r, self._w = os.pipe()  # both ends close-on-exec: actors never hold the write end
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "shm.watchdog", run_id, str(scheduler_pid or os.getpid()), str(r)],
                pass_fds=(r,),
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env=python_env(),
            )
        finally:
            os.close(r)

    def _say(self, line: str) -> None:
        os.write(self._w, (line + "\n").encode())

    def guard_segment(self, name: str) -> None:
        self._say(f"seg {name}")

    def guard_dir(self, path: str) -> None:
        self._say(f"dir {path}")

    def close(self, timeout: float = 2.0) -> None:
        """The scheduler cleaned up itself: say bye, let the watchdog re-check and exit."""
        if self._w < 0:
            return
        try:
            self._say("bye")
        finally:
            os.close(self._w)
            self._w = -1
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _cleanup(segments: list[str], dirs: list[str]) -> int:
    removed = 0
    for name in segments:
        try:
            os.unlink(os.path.join(SHM_DIR, name))
            removed += 1
        except FileNotFoundError:
            pass
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)
    return removed


def main(argv: list[str]) -> int:
    run_id, scheduler_pid, fd = argv[0], int(argv[1]), int(argv[2])
    set_process_name(PROCESS_NAME)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    segments: list[str] = []
    dirs: list[str] = []
    said_bye = False
    pending = b""
    with os.fdopen(fd, "rb", buffering=0) as pipe:
        while chunk := pipe.read(4096):
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                kind, _, arg = line.decode().partition(" ")
                if kind == "seg" and SEGMENT_NAME.match(arg):
                    segments.append(arg)
                elif kind == "dir" and os.path.basename(arg).startswith(f"cadence-{run_id}-"):
                    dirs.append(arg)
                elif kind == "bye":
                    said_bye = True
    removed = _cleanup(segments, dirs)
    if not said_bye:
        print(
            f"cadence watchdog: the scheduler (pid {scheduler_pid}) of run {run_id} died without cleaning up; "
            f"removed {removed} shared-memory segment(s)",
            file=sys.stderr,
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
