"""The live monitor: renders real numbers from a fake-actor run into Rich's recording console,
falls back to plain log lines off a terminal, and its feed keeps the right figures."""

from __future__ import annotations

import argparse
import io
import os
import re
import time
from collections import Counter

from rich.console import Console

from actors import wire
from observe.lines import LogMonitor, NullMonitor
from observe.monitor import Monitor, add_monitor_args, memory_bar, open_monitor, sparkline, text_tail
from observe.state import ActorRow, MemoryPart, MonitorState
from observe.feed import MonitorFeed
from scheduler.events import DeadEvent, ReplyEvent
from scheduler.runtime import Runtime
from tests.runtime.fake_run import fake_model, fake_plan, prompt, small_config, speculation


def _recording(width=120) -> Console:
    return Console(record=True, width=width, file=io.StringIO(), force_terminal=False, color_system=None)


def test_monitor_renders_real_numbers_from_a_fake_run(tmp_path):
    console = _recording()
    cycles = []  # (tokens committed, accepted, alpha) of each cycle, as `launch run` feeds the monitor
    plan = fake_plan()
    with Runtime(small_config(None, plan)) as s:
        spec = speculation(s, fake_model(tmp_path, seed=2), "tree", plan)
        pids = {role: a.pid for role, a in s.actors.items()}
        feed = MonitorFeed(s)
        mon = Monitor(feed, console=console, refresh_hz=20)
        mon.start()

        def on_cycle(st):
            cycles.append((len(st.tokens), st.accepted, st.alpha))
            feed.on_tokens(len(st.tokens), st.accepted, st.alpha)
            feed.on_text(f"<{sum(c[0] for c in cycles)}>")

        try:
            gen = spec.loop.generate(prompt(), 40, set(), on_cycle=on_cycle)
            time.sleep(0.3)  # let the ledger's sampler (every 0.2 s) see every actor
            state = feed.snapshot()
        finally:
            mon.stop()
            spec.close()
    assert mon.frames >= 2  # Live's thread drew while the run went on
    assert s.pump.listeners == []  # stop closed the feed
    # the snapshot: the run's real figures
    tokens = len(gen.new_ids)
    verified = [(a, alpha) for _, a, alpha in cycles if a is not None]
    assert state.tokens == tokens and sum(c for _, c in state.accepted_hist) == len(verified) > 0
    assert dict(state.accepted_hist) == dict(Counter(a for a, _ in verified))
    assert state.alpha == tuple(alpha for _, alpha in verified)
    assert {a.role: a.pid for a in state.actors} == {"scheduler": os.getpid(), **pids}
    assert all(a.state == "ready" and a.uss and a.uss > 0 for a in state.actors if a.role != "scheduler")
    assert state.tokens_per_s > 0 and state.disk_gbps > 0  # the loader's replies carry bytes
    assert state.budget_bytes == s.config.memory.budget_bytes and state.measured_bytes > 0
    assert [p.name for p in state.memory] == ["streaming slots", "arena"]
    assert sum(p.nbytes for p in state.memory) == s.config.memory.arena_bytes
    assert state.text.endswith(f"<{tokens}>")
    # what the console shows: the last frame, drawn from the same numbers
    text = console.export_text()
    last = text[text.rindex("cadence run") :]
    assert f"{tokens} tokens" in last and f"alpha {verified[-1][1]:.3f}" in last
    for role, pid in pids.items():
        assert re.search(rf"\b{role}\s+{pid}\s+ready\b", last)
    assert "accepted length" in last and f"<{tokens}>" in last and " held of " in last
    mean = sum(a for a, _ in verified) / len(verified)
    assert f"mean accepted {mean:.2f}" in last


STATE = MonitorState(
    elapsed_s=12.5,
    title="run 1x00",
    actors=(
        ActorRow("scheduler", 100, "running", None, None, 12.0, 50 << 20),
        ActorRow("verifier", 101, "ready", "verify_layer", 0.012, 97.0, 300 << 20),
        ActorRow("loader", 102, "dead"),
    ),
    budget_bytes=8 << 30,
    memory=(
        MemoryPart("draft", 1 << 30),
        MemoryPart("target resident", 3 << 30),
        MemoryPart("KV", 512 << 20),
        MemoryPart("streaming slots", 256 << 20),
        MemoryPart("arena", 256 << 20),
    ),
    measured_bytes=5 << 30,
    tokens=120,
    tokens_per_s=9.75,
    accepted_hist=((0, 2), (1, 4), (3, 6)),
    alpha=(0.5, 0.45, 0.55),
    disk_gbps=1.234,
    text="line one\nline two\n" + "x" * 250,
    notes=("the loader actor was killed",),
)


def test_render_of_a_hand_made_state():
    console = _recording(width=100)
    mon = Monitor(console=console)
    console.print(mon.render(STATE))
    out = console.export_text()
    assert "cadence run 1x00  12.5 s" in out
    assert "120 tokens  9.8 tok/s (avg 9.6)  mean accepted 1.83  alpha 0.550  disk 1.23 GB/s" in out
    assert re.search(r"verifier\s+101\s+ready\s+verify_layer\s+12 ms\s+97\s+300.00 MiB", out)
    assert re.search(r"loader\s+102\s+dead\s+idle\s+-\s+-", out)
    assert "5.0G planned of 8.0G" in out and "5.0G held of 8.0G budget" in out and "target resident 3.0G" in out
    assert "the loader actor was killed" in out and "0.450 .. 0.550 over 3 verifications" in out
    assert out.count("x" * 100) == 2 and "line two" in out  # the text tail, wrapped at the width
    assert STATE.mean_accepted == (0 * 2 + 1 * 4 + 3 * 6) / 12
    bar = "".join(t for t, _ in memory_bar(STATE, 40))
    assert bar == "█" * 25 + "░" * 15 and len(sparkline([1, 2, 3])) == 3 and sparkline([]) == ""
    assert text_tail("ab\ncdefg", 2, 3) == ["cd", "ef", "g"] and text_tail("", 5, 2) == []


def test_a_failing_snapshot_is_shown_not_fatal():
    calls = iter([STATE])
    console = _recording()
    mon = Monitor(lambda: next(calls), console=console)  # the second call raises StopIteration
    for _ in range(3):
        mon.update()
    console.print(mon.render())
    out = console.export_text()
    assert "120 tokens" in out and out.count("monitor: the snapshot failed: StopIteration") == 1


def test_plain_log_lines_when_stdout_is_not_a_terminal():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    feed = MonitorFeed(None, budget_bytes=1 << 30, title="t")
    try:
        assert isinstance(
            open_monitor(feed, None, stdout=io.StringIO()), LogMonitor
        )  # default off a terminal: log lines
        assert isinstance(open_monitor(feed, False, stdout=Tty()), NullMonitor)
        assert isinstance(open_monitor(feed, None, stdout=Tty()), Monitor)
        mon = open_monitor(feed, True, stdout=io.StringIO())
        assert isinstance(mon, LogMonitor) and not mon.shows_text
        log = io.StringIO()
        mon.file, mon.every_s = log, 0.05
        mon.start()
        feed.on_tokens(5, accepted=2, alpha=0.4)
        feed.on_tokens(3, accepted=4, alpha=0.3)
        time.sleep(0.3)
        mon.stop()
    finally:
        feed.close()
    lines = log.getvalue().splitlines()
    assert len(lines) >= 3
    assert re.match(
        r"cadence +\d+\.\ds tokens 8 [\d.]+ tok/s accepted 3.00 alpha 0.300 disk 0.00 GB/s mem [\d.]+ MiB held of 1.00 GiB"
        r"( \(\+[\d.]+ MiB of mapped code\))? \| main running cpu [\d-]+% uss .*",
        lines[-1],
    )
    assert "\x1b" not in log.getvalue()  # plain text
    assert LogMonitor.line(STATE).endswith("| the loader actor was killed")


def test_feed_callbacks():
    feed = MonitorFeed(None, text_chars=10, alpha_points=3)
    try:
        for piece in ("abc", "def", "ghi", "jkl", "mno"):
            feed.on_text(piece)
        feed.on_text("")
        for a in (0.1, 0.2, 0.3, 0.4):
            feed.on_tokens(2, accepted=1, alpha=a)
        feed.on_tokens(1)  # the prefill's token: no verification
        feed.on_event(ReplyEvent("loader", "load", wire.Reply(1, True, {"bytes": 2_000_000_000}, {}, None)))
        feed.on_event(ReplyEvent("loader", "load", wire.Reply(3, True, {"group": "l0", "bytes": 10**9}, {}, None)))
        feed.on_event(ReplyEvent("verifier", "layer", wire.Reply(2, True, {"bytes": 5}, {}, None)))  # not I/O
        feed.on_event(DeadEvent("draft", "was killed by SIGKILL"))
        time.sleep(0.05)
        s = feed.snapshot()
    finally:
        feed.close()
    assert s.text == "defghijklmno" and s.tokens == 9 and s.accepted_hist == ((1, 4),) and s.alpha == (0.2, 0.3, 0.4)
    assert s.notes == ("the draft actor was killed by SIGKILL",)
    assert s.disk_gbps > 3 / s.elapsed_s * 0.9 and s.tokens_per_s > 0
    assert [a.role for a in s.actors] == ["main"] and s.actors[0].pid == os.getpid()


def test_monitor_args():
    p = argparse.ArgumentParser()
    add_monitor_args(p)
    assert p.parse_args([]).monitor is None and p.parse_args(["--monitor"]).monitor is True
    assert p.parse_args(["--no-monitor"]).monitor is False
    assert p.parse_args(["--trace", "t/run.json"]).trace_path == "t/run.json"


def test_a_frame_fits_80x24_and_shows_no_plan_without_a_budget():
    import dataclasses

    console = Console(record=True, width=80, height=24, file=io.StringIO(), force_terminal=True)
    mon = Monitor(console=console)
    state = dataclasses.replace(STATE, text="long line\n" * 40, accepted_hist=tuple((k, k + 1) for k in range(12)))
    lines = mon.render(state).lines
    assert len(lines) <= 24 and all(sum(len(t) for t, _ in ln) <= 80 for ln in lines)
    unplanned = mon.render(dataclasses.replace(state, planned=False, budget_bytes=24 << 30))
    text = "\n".join("".join(t for t, _ in ln) for ln in unplanned.lines)
    assert "planned" not in text and "held of 24.0G RAM" in text


def test_overhead_bench_runs():
    """The benchmark behind BENCHMARKS.md runs end to end (tiny; no timing is asserted)."""
    from bench.monitor import bench, format_result

    r = bench(pairs=1, tokens=10, cpu_s=0.2)
    assert r["generation"]["off_rate"] > 0 and r["generation"]["on_rate"] > 0 and r["cpu"]["median_ratio"] > 0
    assert all(b["frames"] >= 1 for b in r["generation"]["blocks"]["on"])
    assert r["frame"]["frame_ms"] > 0 and "median of 1 pairs" in format_result(r)
