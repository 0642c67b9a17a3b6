"""The memory ledger (plan arithmetic, live USS/PSS) and the config's own checks."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from common.errors import CadenceError
from scheduler.runtime_config import GiB, MiB, MemoryConfig, PipelineConfig, RuntimeConfig, Timeouts, TraceConfig
from scheduler.ledger import BudgetError, MemoryLedger, fmt_bytes
from scheduler.runtime import Runtime
from shm.arena import run_segments
from tests.runtime.conftest import wait_until


def test_plan_that_fits_reports_its_lines():
    plan = MemoryLedger(4 * GiB).plan({"draft": 1 * GiB, "verifier": 2 * GiB}, 512 * MiB)
    assert plan.total == 3 * GiB + 512 * MiB and plan.headroom == 512 * MiB
    assert "shared arena" in plan.report() and "4.00 GiB budget" in plan.report()


def test_plan_that_does_not_fit_names_the_shortfall_and_the_setting():
    with pytest.raises(BudgetError) as e:
        MemoryLedger(2 * GiB).plan({"draft": 1 * GiB, "verifier": 1536 * MiB}, 256 * MiB)
    msg = str(e.value)
    assert "needs 2.75 GiB but memory.budget_bytes is 2.00 GiB (short by 768.00 MiB" in msg
    assert "largest: verifier 1.50 GiB" in msg and "raise memory.budget_bytes" in msg
    assert isinstance(e.value, CadenceError) and "\n" not in msg


def test_scheduler_refuses_a_plan_before_creating_anything():
    cfg = RuntimeConfig(
        memory=MemoryConfig(
            budget_bytes=64 * MiB, arena_bytes=32 * MiB, stream_bytes=16 * MiB, role_bytes={"verifier": 48 * MiB}
        )
    )
    s = Runtime(cfg)
    with pytest.raises(BudgetError, match="short by 16.00 MiB"):
        with s:
            pass
    assert not run_segments(s.run_id)


def test_live_accounting_sees_a_real_process(tmp_path):
    """40 MiB allocated are held; 32 MiB of a file mapped and read count in the PSS but not as held (the page
    cache's, as a run's code is), so the monitor never shows a budget kept as overrun."""
    data = tmp_path / "mapped.bin"
    data.write_bytes(os.urandom(32 << 20))
    code = (
        "import mmap, time; b = bytearray(40 << 20); f = open(%r, 'rb');"
        "m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ); s = sum(m[i] for i in range(0, len(m), 4096));"
        "print('ready', flush=True); time.sleep(30)" % str(data)
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        ledger = MemoryLedger(1 * GiB)
        usage = ledger.sample({"draft": child.pid, "gone": 2**22 + 12345})
        assert set(usage) == {"draft"}  # a vanished pid is skipped, not an error
        u = usage["draft"]
        assert 40 * MiB < u.uss <= u.pss <= u.rss
        assert 40 * MiB < u.held <= u.pss - 30 * MiB
        assert ledger.pss_total() == u.pss and ledger.held_total() == u.held and "draft" in ledger.report()
    finally:
        child.kill()
        child.wait()


def test_fmt_bytes():
    assert [fmt_bytes(n) for n in (12, 2048, 3 * MiB, 5 * GiB)] == ["12 B", "2.00 KiB", "3.00 MiB", "5.00 GiB"]


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: Timeouts(init_s=0), r"timeouts.init_s must be > 0, got 0"),
        (lambda: Timeouts(heartbeat_s=-1.0), r"timeouts.heartbeat_s must be > 0, got -1.0"),
        (
            lambda: MemoryConfig(stream_bytes=128 * MiB, arena_bytes=64 * MiB),
            r"memory.stream_bytes must be an int in \[0, memory.arena_bytes",
        ),
        (lambda: MemoryConfig(role_bytes={"draft": -1}), r"memory.role_bytes\['draft'\] must be an int >= 0, got -1"),
        (lambda: PipelineConfig(layer_bytes=0), r"pipeline.layer_bytes must be > 0, got 0"),
        (lambda: PipelineConfig(layer_bytes=1.5), r"pipeline.layer_bytes must be an int, got 1.5"),
        (lambda: TraceConfig(max_events=0), r"trace.max_events must be > 0"),
        (
            lambda: RuntimeConfig(
                memory=MemoryConfig(stream_bytes=1 * MiB), pipeline=PipelineConfig(layer_bytes=1 * MiB)
            ),
            r"memory.stream_bytes=1048576 holds fewer than two streaming slots of pipeline.layer_bytes=1048576",
        ),
    ],
)
def test_config_rejects_bad_values_naming_field_and_value(make, match):
    with pytest.raises(CadenceError, match=match):
        make()


def test_background_sampling_follows_watched_processes():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    ledger = MemoryLedger(1 * GiB)
    try:
        ledger.watch("loader", child.pid)
        ledger.start_sampling(0.05)
        assert wait_until(lambda: "loader" in ledger.last, 5)
        ledger.unwatch("loader")
        n = ledger.samples
        assert wait_until(lambda: ledger.samples > n + 1 and "loader" not in ledger.last, 5)
    finally:
        ledger.stop_sampling()
        child.kill()
        child.wait()
    assert not ledger._thread.is_alive()
