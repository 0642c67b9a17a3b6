"""shm/: arenas across processes, the sweeper, the slot allocator and its leases, tensor views."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import gc

import pytest
import torch

from common.errors import CadenceError
from shm.arena import SHM_DIR, Arena, new_run_id, run_segments, segment_name, sweep_dead_segments
from shm.desc import TensorDesc
from shm.slots import SlotAllocator, SlotsFull
from shm.tensors import put, view
from shm.watchdog import REPO_ROOT, Watchdog, python_env
from tests.runtime.conftest import alive, wait_until


@pytest.fixture
def arena():
    a = Arena.create(new_run_id(), "test", 1 << 20)
    yield a
    a.close()
    a.unlink()


def test_arena_is_shared_with_another_process_without_copies(arena):
    assert arena.nbytes == 1 << 20 and arena.name.startswith("cadence-")
    arena.buf[4096:4100] = b"ping"
    code = (
        "import sys; from shm.arena import Arena; a = Arena.attach(sys.argv[1]); "
        "assert bytes(a.buf[4096:4100]) == b'ping'; a.buf[8192:8196] = b'pong'; a.close()"
    )
    subprocess.run([sys.executable, "-c", code, arena.name], check=True, env=python_env(), cwd=REPO_ROOT)
    assert bytes(arena.buf[8192:8196]) == b"pong"  # the child wrote into our mapping


def test_arena_size_rounds_to_pages_and_attach_refuses_strangers():
    a = Arena.create(new_run_id(), "odd", 5000)
    try:
        assert a.nbytes == 8192
        with pytest.raises(CadenceError, match="does not exist"):
            Arena.attach(a.name.replace("-odd", "-gone"))
        with pytest.raises(ValueError, match="not a cadence segment"):
            Arena.attach("../etc/passwd")
    finally:
        a.close()
        a.unlink()
    assert not os.path.exists(os.path.join(SHM_DIR, a.name))


def test_arena_too_large_for_dev_shm_is_a_clear_error():
    run_id = new_run_id()
    with pytest.raises(CadenceError, match="memory.arena_bytes"):
        Arena.create(run_id, "huge", 1 << 50)
    assert not run_segments(run_id)


def test_sweep_removes_dead_runs_only():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that is gone
    dead_name = segment_name(f"{dead.pid}x0bad", "main")
    fd = os.open(os.path.join(SHM_DIR, dead_name), os.O_CREAT | os.O_RDWR, 0o600)
    os.close(fd)
    live = Arena.create(new_run_id(), "live", 4096)  # our own pid: alive
    try:
        removed = sweep_dead_segments()
        assert dead_name in removed
        assert not os.path.exists(os.path.join(SHM_DIR, dead_name))
        assert os.path.exists(os.path.join(SHM_DIR, live.name))
    finally:
        live.close()
        live.unlink()


def test_watchdog_unlinks_when_its_scheduler_dies():
    """A scheduler SIGKILLed before it cleaned up: its watchdog removes the segment."""
    code = (
        "import sys, time; from shm.arena import Arena, new_run_id, segment_name; from shm.watchdog import Watchdog\n"
        "rid = new_run_id(); w = Watchdog(rid); w.guard_segment(segment_name(rid, 'main'))\n"
        "a = Arena.create(rid, 'main', 4096); print(rid, w.proc.pid, flush=True); time.sleep(60)"
    )
    p = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=python_env(),
        cwd=REPO_ROOT,
    )
    run_id, wd_pid = p.stdout.readline().split()
    assert run_segments(run_id)
    p.kill()
    p.wait()
    assert wait_until(lambda: not run_segments(run_id), 5.0), "the watchdog did not unlink"
    assert wait_until(lambda: not alive(int(wd_pid)), 5.0)
    p.stdout.close()
    assert f"the scheduler (pid {p.pid}) of run {run_id} died" in p.stderr.read()  # inherited stderr
    p.stderr.close()


def test_watchdog_bye_is_quiet(capfd):
    w = Watchdog(new_run_id())
    w.close()
    assert w.proc.returncode == 0
    assert "died" not in capfd.readouterr().err


# -- slots ------------------------------------------------------------------------------------


def test_slots_align_and_refuse_clearly_when_full():
    s = SlotAllocator(64 * 1024, align=4096, name="loader slots", setting="memory.stream_bytes")
    a = s.alloc(1)
    b = s.alloc(5000)
    assert (a.offset, a.nbytes, b.offset, b.nbytes) == (0, 4096, 4096, 8192)
    assert s.used_bytes == 12288
    with pytest.raises(SlotsFull, match=r"loader slots cannot fit .* raise memory.stream_bytes"):
        s.alloc(64 * 1024)
    assert s.try_alloc(64 * 1024) is None
    s.free(a)
    s.free(b)
    assert s.used_bytes == 0 and s.alloc(64 * 1024).nbytes == 64 * 1024  # coalesced back to one block


def test_leased_slot_is_not_reused_until_released():
    s = SlotAllocator(8192)
    a = s.alloc(4096)
    s.lease(a, "verifier")
    s.lease(a, "sparse")
    s.free(a)  # the owner is done, the readers are not
    assert s.used_bytes == 4096
    b = s.alloc(4096)
    assert b.offset != a.offset
    assert s.try_alloc(1) is None
    s.release(a, "verifier")
    assert s.try_alloc(1) is None  # sparse still reads it
    s.release(a, "sparse")
    assert s.alloc(4096).offset == a.offset
    with pytest.raises(ValueError, match="holds no lease"):
        s.release(b, "verifier")


def test_slot_allocator_random_workload_never_exceeds_or_overlaps(seed):
    rng = random.Random(seed)
    s = SlotAllocator(1 << 20, align=4096)
    live = []
    for _ in range(3000):
        if live and rng.random() < 0.45:
            slot = live.pop(rng.randrange(len(live)))
            if rng.random() < 0.3:
                s.lease(slot, "c")
                s.free(slot)
                s.release(slot, "c")
            else:
                s.free(slot)
        else:
            slot = s.try_alloc(rng.randint(1, 200_000))
            if slot is not None:
                assert slot.offset % 4096 == 0
                live.append(slot)
        spans = sorted((x.offset, x.offset + x.nbytes) for x in live)
        assert all(e1 <= s2 for (_, e1), (s2, _) in zip(spans, spans[1:])), "overlapping slots"
        assert s.used_bytes == sum(x.nbytes for x in live) <= s.capacity
    assert s.peak_bytes <= s.capacity
    for x in live:
        s.free(x)
    assert s.used_bytes == 0 and s.largest_free() == s.capacity


# -- tensors ----------------------------------------------------------------------------------


def test_put_view_is_zero_copy_and_handles_strides(arena):
    t = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    d = put(arena, 4096, t.t())  # non-contiguous source: compacted in the one copy
    v = view(arena, d)
    assert torch.equal(v, t.t()) and v.is_contiguous()
    v[0, 0] = 100.0
    assert view(arena, d)[0, 0] == 100.0  # the same bytes, not a copy
    tr = TensorDesc(d.segment, d.offset, d.dtype, (d.shape[1], d.shape[0]), (d.strides[1], d.strides[0]))
    assert torch.equal(view(arena, tr), view(arena, d).t())  # a strided descriptor over bytes already there


def test_view_rejects_descriptors_past_the_arena(arena):
    d = TensorDesc(arena.name, arena.nbytes - 4096, "float32", (2048,), (1,))
    with pytest.raises(ValueError, match="past the end"):
        view(arena, d)
    with pytest.raises(ValueError, match="does not fit"):
        put(arena, arena.nbytes - 8, torch.zeros(4, dtype=torch.float64))


def test_arena_close_with_live_views_is_safe():
    a = Arena.create(new_run_id(), "views", 8192)
    v = view(a, put(a, 0, torch.ones(4)))
    a.close()  # the view keeps the mapping alive: no munmap under it
    a.unlink()
    del a
    gc.collect()
    assert v.sum().item() == 4.0
