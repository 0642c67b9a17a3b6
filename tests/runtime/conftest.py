"""Shared checks for the runtime tests: a run leaves no segment, no process, no socket dir."""

from __future__ import annotations

import glob
import os
import tempfile
import time

import psutil
import pytest

from shm.arena import run_segments


def wait_until(pred, timeout: float, step: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step)
    return pred()


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def assert_clean(run_id: str, pids=(), timeout: float = 3.0) -> None:
    """No /dev/shm segment of the run, none of its processes, no orphan child of ours, no run dir."""
    assert wait_until(lambda: not run_segments(run_id), timeout), f"leftover segments: {run_segments(run_id)}"
    assert wait_until(lambda: not any(alive(p) for p in pids), timeout), (
        f"leftover processes: {[p for p in pids if alive(p)]}"
    )
    kids = [c for c in psutil.Process().children(recursive=True) if c.status() != psutil.STATUS_ZOMBIE]
    assert not kids, f"orphan child processes: {[(c.pid, c.cmdline()[-1][:60]) for c in kids]}"
    assert not glob.glob(os.path.join(tempfile.gettempdir(), f"cadence-{run_id}-*")), "leftover run directory"


@pytest.fixture
def seed(request) -> int:
    """A seed for randomised tests: printed, and taken from $CADENCE_TEST_SEED to reproduce."""
    s = int(os.environ.get("CADENCE_TEST_SEED") or int.from_bytes(os.urandom(3), "little"))
    print(f"\n{request.node.name}: seed {s} (rerun with CADENCE_TEST_SEED={s})")
    return s
