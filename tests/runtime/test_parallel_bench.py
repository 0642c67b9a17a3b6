"""`python -m bench.parallel` (issue 42's benchmark): a cycle's chunks grouped by when they came, the aggregate while
every slot is busy, and a real run of the default models end to end (tiny sizes; no timing is asserted)."""

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.parallel import cycles, while_full

ROOT = Path(__file__).resolve().parents[2]


def test_a_cycles_chunks_come_in_one_burst_and_the_drain_is_left_out():
    chunks = [(0.5, "a", 1), (0.501, "b", 1), (1.0, "a", 3), (1.004, "b", 2), (1.6, "b", 1)]  # "a" ends at 1.0
    got = cycles(chunks)
    assert [(k, t) for _, k, t in got] == [(2, 2), (2, 5), (1, 1)]
    assert [round(s, 3) for s, _, _ in got] == [0.501, 0.503, 0.596]  # each from the last cycle's end
    run = {"cycles": got}
    assert while_full(run, 2) == pytest.approx(7 / 1.004)  # the last cycle, "b" alone, left out
    assert while_full(run, 1) == pytest.approx(8 / 1.6)  # one at a time: every cycle
    assert while_full(run, 3) is None and while_full({}, 1) is None


def test_the_benchmark_runs_one_at_a_time_and_two_together_losslessly():
    cmd = [sys.executable, "-m", "bench.parallel", "--prompts", "engine/assets/dev.jsonl", "--limit", "3"]
    argv = [*cmd, "--max-new-tokens", "8", "--parallel", "2"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {
        line.split("|")[1].strip(): [c.strip() for c in line.split("|")[1:-1]]
        for line in out.stdout.splitlines()
        if line.startswith("| 1 ") or line.startswith("| 2 ")
    }
    one, two = rows["1"], rows["2"]
    assert one[1] == "one at a time" and two[1] == "--parallel 2"
    assert one[-1] == two[-1] == "yes"  # each generation token for token as one at a time
    assert float(one[5]) == pytest.approx(float(one[3]), rel=0.05)  # alone, the two figures are one
    assert float(two[5]) > 0 and two[6].endswith("x")


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"  # exited, not yet reaped
    except (FileNotFoundError, ProcessLookupError):
        return True


def test_sigterm_stops_the_benchmark_leaving_no_cgroup_process_or_segment():
    """SIGTERM while a run is under way in its memory cgroup: one line, exit 143, and the run's processes, its cgroup
    and its shared memory are gone (before, the cgroup stayed and made later cgroup runs see a leftover)."""
    from tests.conftest import memory_cgroup_or_skip, shm_segments

    info = memory_cgroup_or_skip()
    before = shm_segments()
    argv = [sys.executable, "-m", "bench.parallel", "--prompts", "engine/assets/dev.jsonl", "--limit", "2"]
    p = subprocess.Popen(
        [*argv, "--max-new-tokens", "64", "--parallel", "2", "--memory-budget", "1GiB"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    members, deadline = [], time.monotonic() + 300
    while not members and p.poll() is None and time.monotonic() < deadline:
        for d in info.own_dir.glob(f"cadence-{p.pid}-*"):  # a run under way inside, with its actors
            try:
                members = [int(x) for x in (d / "cgroup.procs").read_text().split()]
            except FileNotFoundError:
                pass
        members = members if len(members) >= 3 else []
        time.sleep(0.05)
    assert members, "no run started in a cgroup"
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 143, err[-2000:]
    assert err.strip().splitlines()[-1].startswith("bench.parallel: stopped by SIGTERM") and "Traceback" not in err
    assert not list(info.own_dir.glob(f"cadence-{p.pid}-*"))
    deadline = time.monotonic() + 30
    while not all(_gone(pid) for pid in members) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_gone(pid) for pid in members)
    while shm_segments() - before and time.monotonic() < deadline:  # a killed run's watchdog clears them
        time.sleep(0.1)
    assert not shm_segments() - before
