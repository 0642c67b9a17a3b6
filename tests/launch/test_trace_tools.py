"""`launch trace summary`: figures on a hand-made trace with known answers, and on a real one."""

from __future__ import annotations

import argparse
import json

import pytest

from launch import cmd_trace
from observe.intervals import exclusive, intersect, length, subtract, union
from observe.summary import format_summary, summarize, summary_dict
from observe.traces import load_trace, place_trace, trace_dir


def test_interval_algebra():
    assert union([(5, 7), (0, 2), (1, 3), (7, 8), (9, 9)]) == [(0, 3), (5, 8)]
    assert length([(0, 3), (5, 8)]) == 6
    assert intersect([(0, 3), (5, 8)], [(2, 6), (7, 10)]) == [(2, 3), (5, 6), (7, 8)]
    assert subtract([(0, 10)], [(2, 3), (5, 6), (9, 12)]) == [(0, 2), (3, 5), (6, 9)]
    assert subtract([(0, 2), (4, 6)], [(-1, 1), (5, 7)]) == [(1, 2), (4, 5)]
    assert subtract([(0, 1)], []) == [(0, 1)] and intersect([], [(0, 1)]) == []


def _meta(pid, name, tids=()):
    evs = [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}}]
    return evs + [{"ph": "M", "name": "thread_name", "pid": pid, "tid": t, "args": {"name": f"t{t}"}} for t in tids]


def _x(pid, tid, name, cat, ts, dur, **args):
    return {"ph": "X", "pid": pid, "tid": tid, "name": name, "cat": cat, "ts": ts, "dur": dur, "args": args}


# microseconds. scheduler 1; draft 2; verifier 3; loader 4 (two threads); sparse 5.
HAND = {
    "traceEvents": [
        *_meta(1, "scheduler", [1]),
        *_meta(2, "draft (D)", [2]),
        *_meta(3, "verifier (V)", [3]),
        *_meta(4, "loader (L)", [40, 41]),
        *_meta(5, "sparse (S)", [5]),
        _x(1, 1, "call load", "scheduler", 0, 10),
        _x(1, 1, "send load", "scheduler", 0, 2),  # call: waiting for a reply
        _x(3, 3, "load target", "setup", -5000, 4000),  # loading weights: outside the window
        _x(4, 40, "load", "load", 0, 100),
        _x(4, 41, "load", "load", 50, 100),
        _x(4, 40, "load", "load", 200, 100),
        _x(2, 2, "draft_step", "draft", 100, 100),
        _x(2, 2, "compute", "draft", 120, 60),
        _x(3, 3, "verify", "verify", 150, 100),
        _x(3, 3, "wait:layer", "verify", 150, 50),  # waits inside its own span
        _x(3, 3, "verify", "verify", 300, 100),
        _x(5, 5, "sparse_attn", "attention", 320, 60),
        _x(2, 2, "mystery", "gpu-thing", 420, 20),  # an unknown category
        {"ph": "C", "pid": 1, "tid": 1, "name": "tokens", "ts": 410, "args": {"total": 4}},
        {"ph": "s", "pid": 2, "tid": 2, "name": "draft tree", "cat": "tree", "id": 1, "ts": 150},
        {"ph": "f", "pid": 3, "tid": 3, "name": "draft tree", "cat": "tree", "id": 1, "ts": 200, "bp": "e"},
    ],
    "otherData": {"run_id": "hand"},
}


def test_summary_of_a_hand_made_trace():
    s = summarize(HAND)
    assert s.run_id == "hand" and s.window_s == pytest.approx(440e-6) and s.tokens == 4
    busy = {a.role: (a.threads, a.busy_s * 1e6, a.busy_pct) for a in s.actors}
    assert busy == {
        "scheduler": (1, pytest.approx(2), pytest.approx(100 * 2 / 440)),
        "draft": (1, pytest.approx(120), pytest.approx(100 * 120 / 440)),
        "verifier": (1, pytest.approx(150), pytest.approx(100 * 150 / 440)),
        "loader": (2, pytest.approx(250), pytest.approx(100 * 250 / 440)),
        "sparse": (1, pytest.approx(60), pytest.approx(100 * 60 / 440)),
    }
    assert [a.role for a in s.actors] == ["scheduler", "draft", "verifier", "loader", "sparse"]
    loader = next(a for a in s.actors if a.role == "loader")
    assert loader.top_ops == [("load", 3, pytest.approx(300e-6))]
    assert [a.setup_s for a in s.actors] == [0, 0, pytest.approx(4000e-6), 0, 0]
    # I/O [0,150] + [200,300]; compute [100,250] + [300,400]: both at once [100,150] + [200,250]
    assert (s.io_s, s.compute_s, s.overlap_s) == pytest.approx((250e-6, 250e-6, 100e-6))
    assert s.overlap_pct == pytest.approx(40.0)
    # the verifier: busy [200,250] + [300,400]; waited 50 in wait:layer; gaps [0,150] + [250,300] under a load,
    # [400,440] with nothing it waits for running
    assert s.verifier_busy_s == pytest.approx(150e-6)
    assert s.waits == {"layer": (1, pytest.approx(50e-6))}
    assert s.gaps == pytest.approx({"layer": 200e-6, "tree": 0.0, "attention": 0.0, "idle": 40e-6})
    # each instant once: verify [200,250] + [300,400]; draft [100,200]; load [0,100] + [250,300];
    # other (the unknown category) [420,440]; idle [400,420]
    assert s.split_s == pytest.approx(
        {"verify": 150e-6, "draft": 100e-6, "load": 150e-6, "other": 20e-6, "idle": 20e-6}
    )
    assert sum(s.split_s.values()) == pytest.approx(s.window_s)
    assert s.per_token_ms == pytest.approx(
        {"verify": 0.0375, "draft": 0.025, "load": 0.0375, "other": 0.005, "idle": 0.005}
    )
    assert s.categories["other"] == pytest.approx(20e-6)
    text = format_summary(s)
    assert "40.0% of I/O overlapped with compute" in text and "wait:layer" in text
    assert "verifier (V)" in text and "0.04 ms/token" in text and "unknown categories" in text
    assert "loading weights: verifier 0.00 s" in text
    assert summarize(HAND, tokens=8).per_token_ms["verify"] == pytest.approx(0.01875)
    json.dumps(summary_dict(s))  # JSON-able


def test_self_time_of_nested_spans():
    spans = [(0, 10, "a"), (2, 4, "b"), (3, 4, "c"), (6, 12, "d"), (20, 21, "e")]  # d sticks out of a: cut at 10
    assert exclusive(spans) == [(0, 2, "a"), (2, 3, "b"), (3, 4, "c"), (4, 6, "a"), (6, 10, "d"), (20, 21, "e")]
    assert exclusive([]) == []


def test_summary_copes_with_bare_lists_and_missing_names():
    bare = [
        _x(7, 1, "a", "", 0, 10),
        _x(7, 1, "b", "verify", 20, 10),
        {"ph": "C", "name": "accepted", "ts": 25, "pid": 7, "args": {"length": 2, "tree": 4}},
    ]
    s = summarize(bare)
    assert s.actors[0].name == "pid 7" and s.tokens == 3 and s.overlap_pct is None
    assert s.split_s == pytest.approx({"verify": 10e-6, "draft": 0, "load": 0, "other": 10e-6, "idle": 10e-6})
    empty = summarize({"traceEvents": []})
    assert empty.window_s == 0 and empty.actors == [] and empty.per_token_ms is None
    assert "0.0 ms of spans" in format_summary(empty)


def test_summary_of_a_real_fake_run(fake_trace):
    s = summarize(load_trace(fake_trace.path))
    assert s.tokens == fake_trace.tokens
    roles = {a.role: a for a in s.actors}
    assert set(roles) == {"scheduler", "draft", "verifier", "sparse", "loader"}
    assert {a.pid for a in s.actors if a.role != "scheduler"} == set(fake_trace.pids.values())
    assert all(0 < a.busy_pct <= 100 for a in s.actors)
    assert sum(s.split_s.values()) == pytest.approx(s.window_s)
    assert s.split_s["verify"] > 0 and s.split_s["draft"] > 0 and 0 < s.overlap_pct <= 100
    assert s.gaps and sum(s.gaps.values()) + s.verifier_busy_s == pytest.approx(s.window_s)
    assert sum(s.per_token_ms.values()) == pytest.approx(1000 * s.window_s / fake_trace.tokens)


def test_trace_command(fake_trace, tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="launch")
    cmd_trace.add_parser(parser.add_subparsers())
    args = parser.parse_args(["trace", "summary", str(fake_trace.path)])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "busy %" in out and "ms/token" in out and "verifier (FakeVerifierActor)" in out
    args = parser.parse_args(["trace", "summary", "--json", "--tokens", "10", str(fake_trace.path)])
    assert args.func(args) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == 10
    args = parser.parse_args(["trace", "html", str(fake_trace.path), "-o", str(tmp_path / "run.html")])
    assert args.func(args) == 0 and (tmp_path / "run.html").stat().st_size > 10_000
    from common.errors import CadenceError

    with pytest.raises(CadenceError, match="no trace file"):
        args = parser.parse_args(["trace", "summary", str(tmp_path / "nope.json")])
        args.func(args)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(CadenceError, match="not a JSON trace"):
        args = parser.parse_args(["trace", "html", str(tmp_path / "bad.json")])
        args.func(args)


def test_trace_placement(tmp_path):
    assert trace_dir(None) is None and trace_dir(str(tmp_path / "runs")) == str(tmp_path / "runs")
    assert trace_dir(str(tmp_path / "x" / "run.json")) == str(tmp_path / "x")
    written = tmp_path / "x" / "1x00.json"
    written.parent.mkdir()
    written.write_text("{}")
    assert place_trace(written, str(tmp_path / "x" / "run.json")) == tmp_path / "x" / "run.json"
    assert (tmp_path / "x" / "run.json").read_text() == "{}" and not written.exists()
    assert place_trace(tmp_path / "x" / "run.json", str(tmp_path / "x")) == tmp_path / "x" / "run.json"
    assert place_trace(None, "a.json") is None
