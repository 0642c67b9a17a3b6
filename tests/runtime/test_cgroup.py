"""bench/cgroup.py: real memory cgroups where this machine has them (OOM kill, peak, page cache
charged inside, nothing left behind), and detection against fake /proc + /sys trees for the rest."""

from __future__ import annotations

import errno
import os
import secrets
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from common.errors import CadenceError
from bench import cgroup
from bench.cgroup import CgroupInfo, MemoryCgroup, detect, run_in_cgroup
from shm.dio import MEMORY_FS, cached_bytes, fs_type
from tests.runtime.conftest import wait_until

MiB = 1 << 20


def _real_cgroup():
    try:
        return detect(), None
    except (CadenceError, OSError) as e:
        return None, str(e)


INFO, WHY = _real_cgroup()
real = pytest.mark.skipif(INFO is None, reason=f"no usable memory cgroup here: {WHY}")


def py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def leftovers() -> list[str]:
    return [n for n in os.listdir(INFO.own_dir) if n.startswith("cadence-")]


@real
def test_a_child_over_the_limit_is_oom_killed_and_reported():
    run = run_in_cgroup(py("b = bytearray(256 << 20); print('survived')"), 64 * MiB)
    assert run.oom_killed and run.returncode == -9 and "survived" not in run.stdout
    assert run.peak_bytes <= 64 * MiB and not run.timed_out
    assert not leftovers()


@real
def test_a_child_under_the_limit_succeeds_and_its_peak_is_measured():
    run = run_in_cgroup(py("b = bytearray(48 << 20); print(len(b))"), 128 * MiB)
    assert run.returncode == 0 and run.stdout.strip() == str(48 * MiB) and not run.oom_killed
    assert 48 * MiB <= run.peak_bytes <= 128 * MiB
    assert run.wall_s > 0 and run.limit_bytes == 128 * MiB
    assert not leftovers()


@real
def test_page_cache_read_inside_is_charged_to_the_cgroup():
    """A 200 MB file read after eviction inside a 128 MiB cgroup: the cache it fills counts
    against the limit, so the kernel reclaims it; the command is not killed, and the file does
    not stay cached."""
    d = Path("/var/tmp") / f"cadence-test-cgroup-{secrets.token_hex(3)}"
    d.mkdir()
    try:
        if fs_type(d) in MEMORY_FS:
            pytest.skip("/var/tmp is on tmpfs: the page-cache test needs a real disk")
        path = d / "big.bin"
        with open(path, "wb") as f:
            chunk = np.random.default_rng(0).bytes(MiB)
            for _ in range(200):
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        assert cached_bytes(path) > 100 * MiB  # what we wrote is cached (outside the cgroup)...
        run = run_in_cgroup(["dd", f"if={path}", "of=/dev/null", "bs=1M"], 128 * MiB, evict=[path])
        assert run.evicted_bytes > 100 * MiB and run.still_cached_bytes == 0  # ...so it had to go first
        assert run.returncode == 0 and not run.oom_killed, run.stderr
        assert "209715200 bytes" in run.stderr
        assert 64 * MiB < run.peak_bytes <= 128 * MiB  # the cache filled the cgroup up to its limit
        assert cached_bytes(path) <= 128 * MiB < 200 * MiB
    finally:
        for p in d.iterdir():
            p.unlink()
        d.rmdir()
    assert not leftovers()


@real
def test_the_cgroup_is_removed_on_exception_and_its_processes_move_back():
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        with pytest.raises(RuntimeError, match="boom"):
            with MemoryCgroup(32 * MiB) as cg:
                cg.add(sleeper.pid)
                assert cg.pids() == [sleeper.pid] and cg.usage_bytes() >= 0
                where = cg.dir
                raise RuntimeError("boom")
        assert not where.exists()
        assert sleeper.pid in [int(p) for p in (INFO.own_dir / "cgroup.procs").read_text().split()]
    finally:
        sleeper.kill()
        sleeper.wait()
    assert not leftovers()


@real
def test_a_timeout_kills_everything_in_the_cgroup():
    run = run_in_cgroup(["sh", "-c", "sleep 30 & sleep 30"], 64 * MiB, timeout=0.5)
    assert run.timed_out and run.returncode == -9 and run.wall_s < 10
    assert not leftovers()


@real
def test_a_cgroup_left_by_a_killed_run_is_swept_by_the_next_one():
    """A run killed before it could remove its cgroup (SIGKILL) leaves `cadence-PID-...` behind; the next cgroup made
    removes it, as long as its process is gone and it holds none. One whose process lives stays."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    live = subprocess.Popen(["sleep", "30"])
    stale, kept = INFO.own_dir / f"cadence-{dead.pid}-5ca1ed", INFO.own_dir / f"cadence-{live.pid}-a11ve0"
    stale.mkdir()
    kept.mkdir()
    try:
        with MemoryCgroup(64 * MiB, info=INFO) as cg:
            assert cg.dir.exists()
        assert not stale.exists() and kept.exists()
    finally:
        live.kill()
        live.wait()
        for d in (stale, kept):
            if d.exists():
                d.rmdir()
    assert not leftovers()


# -- detection on fake trees -------------------------------------------------------------------


def fake_tree(tmp_path: Path, cgroup: str, mountinfo: list[str], files: dict[str, str]) -> Path:
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text(cgroup)
    (tmp_path / "proc/self/mountinfo").write_text("\n".join(mountinfo) + "\n")
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return tmp_path


V2_MOUNT = "30 23 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate"
V1_MOUNT = "35 29 0:30 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory"
V1_CPU = "34 29 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu"
HYBRID_V2 = "31 29 0:27 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw"


def v2_tree(tmp_path, controllers="cpuset cpu io memory pids", subtree=""):
    own = "sys/fs/cgroup/user.slice/run-1.scope"
    return fake_tree(
        tmp_path,
        "0::/user.slice/run-1.scope\n",
        [V2_MOUNT],
        {
            "sys/fs/cgroup/cgroup.controllers": controllers,
            f"{own}/cgroup.controllers": controllers,
            f"{own}/cgroup.subtree_control": subtree,
            f"{own}/cgroup.procs": "1\n",
        },
    )


def test_detect_v2(tmp_path):
    root = v2_tree(tmp_path)
    info = detect(root)
    assert info == CgroupInfo(2, root / "sys/fs/cgroup", "/user.slice/run-1.scope", "/")
    assert info.own_dir == root / "sys/fs/cgroup/user.slice/run-1.scope"


def test_detect_v2_in_a_cgroup_namespace(tmp_path):
    """Inside a namespace the mount shows only a subtree: own path and mount root line up."""
    root = fake_tree(
        tmp_path,
        "0::/\n",
        ["30 23 0:26 /ctr /sys/fs/cgroup rw - cgroup2 cgroup2 rw"],
        {"sys/fs/cgroup/cgroup.controllers": "memory pids", "sys/fs/cgroup/cgroup.subtree_control": ""},
    )
    assert detect(root).own_dir == root / "sys/fs/cgroup"


def test_detect_hybrid_prefers_the_v1_memory_hierarchy(tmp_path):
    """This machine's layout: v1 controllers plus a unified v2 mount without the memory controller."""
    root = fake_tree(
        tmp_path,
        "9:name=systemd:/\n4:memory:/process_api/abc\n1:cpu:/\n0::/\n",
        [V1_CPU, V1_MOUNT, HYBRID_V2],
        {
            "sys/fs/cgroup/memory/process_api/abc/memory.limit_in_bytes": "9223372036854771712",
            "sys/fs/cgroup/unified/cgroup.controllers": "hugetlb",
        },
    )
    info = detect(root)
    assert info.version == 1 and info.own_path == "/process_api/abc"
    assert info.own_dir == root / "sys/fs/cgroup/memory/process_api/abc"


def test_detect_names_what_is_missing(tmp_path, monkeypatch):
    with pytest.raises(CadenceError, match="no memory cgroup controller .* drop --cgroup"):
        detect(v2_tree(tmp_path / "a", controllers="cpu io pids"))
    with pytest.raises(
        CadenceError, match=r"cannot create a cgroup in .*run-1.scope \(cgroup v2\): it is missing or not writable"
    ):
        monkeypatch.setattr(os, "access", lambda p, mode: False)
        detect(v2_tree(tmp_path / "b"))
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(
        CadenceError, match=r"^--cgroup needs root to create a memory cgroup \(running as uid 1000\); rerun as root"
    ):
        detect(v2_tree(tmp_path / "c"))


def test_v2_files_on_a_fake_tree(tmp_path):
    """The v2 path as far as a plain directory can play cgroupfs: +memory for the children, the
    limit, swap off, the sampled peak (no memory.peak), oom kills from memory.events."""
    root = v2_tree(tmp_path)
    info = detect(root)
    with MemoryCgroup(96 * MiB, name="cadence-test", info=info, sample_s=0.002) as cg:
        assert (info.own_dir / "cgroup.subtree_control").read_text() == "+memory"
        assert (cg.dir / "memory.max").read_text() == str(96 * MiB)
        for v in (10, 70 * MiB):
            (cg.dir / "memory.current").write_text(str(v))
            assert wait_until(lambda: cg._peak >= v, 5.0)
        (cg.dir / "memory.current").write_text("20")
        assert cg.usage_bytes() == 20 and cg.peak_bytes() == 70 * MiB
        (cg.dir / "memory.events").write_text("low 0\nhigh 0\nmax 4\noom 1\noom_kill 1\n")
        assert cg.oom_kills() == 1
        for f in list(cg.dir.iterdir()):  # cgroupfs drops its control files with the directory
            f.unlink()
    assert not (info.own_dir / "cadence-test").exists()


def test_v2_refuses_clearly_when_memory_cannot_be_delegated(tmp_path, monkeypatch):
    root = v2_tree(tmp_path)
    info = detect(root)

    def write(path, value):  # what cgroupfs answers in a cgroup that holds processes itself
        raise OSError(errno.EBUSY, os.strerror(errno.EBUSY))

    monkeypatch.setattr(cgroup, "_write", write)
    with pytest.raises(
        CadenceError,
        match=r"cannot enable the memory controller for children of .*run-1.scope \(Device or resource busy\)",
    ):
        MemoryCgroup(MiB, info=info).__enter__()
    assert sorted(p.name for p in info.own_dir.iterdir()) == [
        "cgroup.controllers",
        "cgroup.procs",
        "cgroup.subtree_control",
    ]
