"""How an actor process stays tied to its scheduler: parent death and signals.

- `PR_SET_PDEATHSIG` asks the kernel to SIGKILL us the moment the scheduler dies, even if we
  are stuck in C code. (The kernel fires it when the *thread* that spawned us exits, so the
  scheduler spawns actors from its main thread.)
- A daemon thread also checks `getppid()` every 0.2 s: it covers the race where the parent died
  before prctl, and systems without prctl. Either way the actor is gone well within 1 s.
- SIGTERM only sets a flag; the run loop sees it within one poll interval. SIGINT is ignored:
  Ctrl-C in a terminal reaches the whole process group, and the scheduler, which gets it too,
  stops every actor itself. An actor that left on its own first would look to the scheduler like
  a crash racing the interrupt. (A dead scheduler is covered by the two checks above.)
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

_PR_SET_PDEATHSIG = 1
PARENT_POLL_S = 0.2


class StopFlag:
    """Set by a signal handler or a STOP message; read by the run loop."""

    def __init__(self):
        self.signum: int | None = None
        self.requested = False

    def set_by_signal(self, signum, frame) -> None:
        self.signum = signum
        self.requested = True

    def __bool__(self) -> bool:
        return self.requested


def install_signal_flags(flag: StopFlag) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, flag.set_by_signal)


def die_with_parent(parent_pid: int, role: str) -> None:
    """Exit (hard) when `parent_pid` is no longer our parent."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the watcher thread below still covers it
    if os.getppid() != parent_pid:
        _exit_orphaned(parent_pid, role)

    def watch():
        while True:
            time.sleep(PARENT_POLL_S)
            if os.getppid() != parent_pid:
                _exit_orphaned(parent_pid, role)

    threading.Thread(target=watch, name="lifeline", daemon=True).start()


def _exit_orphaned(parent_pid: int, role: str) -> None:
    try:
        sys.stderr.write(f"cadence {role}: the scheduler (pid {parent_pid}) died; exiting\n")
        sys.stderr.flush()
    finally:
        os._exit(70)
