"""Chrome traces: the sink writes Trace Event Format that validates; the validator catches what
Perfetto / chrome://tracing would drop or misdraw; a real fake run produces a valid file."""

from __future__ import annotations

import json
import time

from actors.tracing import Tracer
from common.settings import WorkerSplit
from scheduler.runtime_config import TraceConfig
from scheduler.runtime import Runtime
from scheduler.trace import TraceSink, validate_trace
from tests.runtime.conftest import assert_clean
from tests.runtime.fake_run import fake_model, fake_plan, prompt, small_config, speculation


def _sink(tmp_path):
    return TraceSink("1x00", TraceConfig(dir=str(tmp_path)), time.monotonic_ns())


def test_sink_writes_valid_trace_with_names_nesting_counters_and_flows(tmp_path):
    sink = _sink(tmp_path)
    sched, actor = Tracer(), Tracer()
    with sched.span("send verify", cat="scheduler", flow_out=7):
        pass
    with actor.span("verify_layer", cat="verifier", args={"req": 7}, flow_in=7):
        with actor.span("compute", cat="verifier"):
            time.sleep(0.001)
    sched.counter("memory", {"used": 10, "budget": 100})
    sink.name_process(1, "scheduler")
    sink.name_process(2, "verifier (FakeVerifierActor)")
    sink.add(1, sched.drain())
    sink.add(2, actor.drain())
    path = sink.write()
    assert path == tmp_path / "1x00.json"
    obj = json.loads(path.read_text())
    assert validate_trace(obj) == []
    evs = obj["traceEvents"]
    names = {(e["pid"], e["args"]["name"]) for e in evs if e["name"] == "process_name"}
    assert names == {(1, "scheduler"), (2, "verifier (FakeVerifierActor)")}
    assert {e["name"] for e in evs if e["ph"] == "X"} == {"send verify", "verify_layer", "compute"}
    s = next(e for e in evs if e["ph"] == "s")
    f = next(e for e in evs if e["ph"] == "f")
    assert s["id"] == f["id"] == 7 and f["bp"] == "e" and f["ts"] >= s["ts"]
    c = next(e for e in evs if e["ph"] == "C")
    assert c["args"] == {"used": 10, "budget": 100}
    x = next(e for e in evs if e["name"] == "compute")
    assert x["dur"] >= 1000  # microseconds: the 1 ms sleep


def test_sink_drops_flows_that_never_ended_and_junk_from_actors(tmp_path):
    sink = _sink(tmp_path)
    tr = Tracer()
    with tr.span("send load", flow_out=1):  # its actor died before handling it
        pass
    sink.name_process(1, "scheduler")
    sink.add(1, tr.drain())
    sink.add(
        2,
        [
            {"ph": "X", "name": "x", "ts": "soon"},
            {"ph": "B", "name": "y"},
            "junk",
            {"ph": "C", "name": "m", "ts": 1, "args": {"v": float("nan")}},
        ],
    )
    obj = sink.to_json()
    assert validate_trace(obj) == []
    assert obj["otherData"]["unpaired_flow_events"] == 1 and obj["otherData"]["rejected_events"] == 4
    assert not [e for e in obj["traceEvents"] if e["ph"] in "sf"]


def test_sink_caps_events(tmp_path):
    sink = TraceSink("1x01", TraceConfig(dir=str(tmp_path), max_events=5), 0)
    sink.add(1, [{"ph": "X", "name": "x", "ts": i * 10, "dur": 1, "tid": 1} for i in range(8)])
    assert sink.dropped == 3 and len(sink.to_json()["traceEvents"]) == 5


def _ev(ph, name, ts, pid=1, tid=1, **kw):
    return {"ph": ph, "name": name, "ts": ts, "pid": pid, "tid": tid, **kw}


NAMES = [
    {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "p"}},
    {"ph": "M", "name": "thread_name", "pid": 1, "tid": 1, "args": {"name": "t"}},
]


def test_validator_catches_what_viewers_would_drop():
    assert validate_trace({"nope": 1}) == [
        "the trace is neither a list of events nor an object with a traceEvents list"
    ]
    crossing = NAMES + [_ev("X", "a", 0, dur=10), _ev("X", "b", 5, dur=10)]
    assert any("'b' on pid 1 tid 1 starts inside 'a' but ends after it" in p for p in validate_trace(crossing))
    nested = NAMES + [_ev("X", "a", 0, dur=10), _ev("X", "b", 2, dur=8), _ev("X", "c", 10, dur=1)]
    assert validate_trace(nested) == []
    unpaired = NAMES + [_ev("X", "a", 0, dur=10), _ev("s", "r", 1, id=3, cat="flow")]
    assert any("flow flow/3 has 1 start(s) and 0 end(s)" in p for p in validate_trace(unpaired))
    unbound = NAMES + [
        _ev("X", "a", 0, dur=10),
        _ev("s", "r", 1, id=3, cat="flow"),
        _ev("f", "r", 20, id=3, cat="flow", bp="e"),
    ]
    assert any("is inside no slice" in p for p in validate_trace(unbound))
    backwards = NAMES + [
        _ev("X", "a", 0, dur=10),
        _ev("s", "r", 8, id=3, cat="flow"),
        _ev("f", "r", 2, id=3, cat="flow", bp="e"),
    ]
    assert any("ends before it starts" in p for p in validate_trace(backwards))
    unnamed = [_ev("X", "a", 0, dur=1, pid=9)]
    assert {"process 9 has events but no process_name", "thread 1 of process 9 has slices but no thread_name"} <= set(
        validate_trace(unnamed)
    )
    bad = NAMES + [
        _ev("X", "a", 0),
        _ev("C", "m", 0, args={"v": "x"}),
        _ev("Q", "q", 0),
        {"ph": "X", "name": "n", "ts": 0},
    ]
    problems = validate_trace(bad)
    assert any("lacks a dur" in p for p in problems) and any("needs numeric args" in p for p in problems)
    assert any("unknown phase 'Q'" in p for p in problems) and any(
        "lacks a string name or an int pid" in p for p in problems
    )


def test_fake_run_writes_one_valid_trace(tmp_path):
    plan = fake_plan()
    with Runtime(small_config(tmp_path / "traces", plan)) as s:
        spec = speculation(s, fake_model(tmp_path / "model", seed=3), "tree", plan, worker=WorkerSplit(0.3, 0.2))
        pids = {role: a.pid for role, a in s.actors.items()}
        try:
            spec.loop.generate(prompt(), 30, set())
        finally:
            spec.close()
    path = tmp_path / "traces" / f"{s.run_id}.json"
    assert s.trace_path == path and [p.name for p in path.parent.iterdir()] == [path.name]
    obj = json.loads(path.read_text())
    assert validate_trace(obj) == []
    evs = obj["traceEvents"]
    procs = {e["args"]["name"] for e in evs if e["name"] == "process_name"}
    assert procs == {
        "scheduler",
        "draft (FakeDraftActor)",
        "verifier (FakeVerifierActor)",
        "sparse (FakeSparseAttnActor)",
        "loader (FakeLoaderActor)",
    }
    by_pid = {e["pid"] for e in evs if e["ph"] == "X"}
    assert by_pid == set(pids.values()) | {s.pid}, (pids, by_pid, s.pid)  # every process recorded spans
    ops = {e["name"] for e in evs if e["ph"] == "X"}
    assert {"cycle", "begin", "layer", "load", "serve", "send load", "send serve"} <= ops
    assert any(n.startswith("compute:layer.") for n in ops) and any(n.startswith("load:layer.") for n in ops)
    assert any(n.startswith("attn:layer.") for n in ops) and any(
        n.startswith("sparse:attn") for n in ops
    )  # both sides of a split
    counters = {e["name"] for e in evs if e["ph"] == "C"}
    assert {"memory", "loader slots", "queue loader", "queue verifier", "tokens", "accepted", "alpha"} <= counters
    slots = [e["args"] for e in evs if e["ph"] == "C" and e["name"] == "loader slots"]
    assert all(c["used"] <= c["bound"] == plan.stream_bytes for c in slots) and max(c["used"] for c in slots) > 0
    assert slots[-1]["used"] == 0  # every slot came back
    flows = [e for e in evs if e["ph"] in "sf"]
    assert len(flows) > 50 and len(flows) % 2 == 0
    assert obj["otherData"]["run_id"] == s.run_id and obj["otherData"]["unpaired_flow_events"] == 0
    assert_clean(s.run_id, list(pids.values()))


def test_a_trace_spilled_to_disk_is_the_trace_kept_in_memory(tmp_path):
    """Under a budget the scheduler spills events every few thousand; the file it writes at the end
    is the same trace (links, flows and order included), and the spill file is gone."""
    sinks = [
        TraceSink("1x00", TraceConfig(dir=str(tmp_path / d), spill_events=n), 1000)
        for d, n in (("mem", 0), ("spill", 7))
    ]
    for round_ in range(9):
        sched, draft, verifier = Tracer(), Tracer(), Tracer()
        for req in (2 * round_ + 1, 2 * round_ + 2):
            with sched.span("send", cat="scheduler", args={"req": req, "to": "x"}, flow_out=req):
                pass
        with draft.span("build", cat="draft", args={"req": 2 * round_ + 1}, flow_in=2 * round_ + 1):
            time.sleep(0.0002)
        with verifier.span("verify", cat="verifier", args={"req": 2 * round_ + 2}, flow_in=2 * round_ + 2):
            verifier.counter("rows", {"n": round_})
        for sink in sinks:
            sink.name_process(1, "scheduler")
            sink.name_process(2, "draft")
            sink.name_process(3, "verifier")
            sink.add(1, [dict(e) for e in sched.events])
            sink.add(2, [dict(e) for e in draft.events])
            sink.add(3, [dict(e) for e in verifier.events])
            sink.link((2, 2 * round_ + 1), (3, 2 * round_ + 2), "draft tree", "tree")
    assert sinks[1]._runs and len(sinks[1]._events) < 7  # it spilled, and holds little
    a, b = (json.loads(s.write().read_text()) for s in sinks)
    assert a == b and validate_trace(b) == []
    assert sum(1 for e in b["traceEvents"] if e.get("cat") == "tree") == 18  # every link resolved
    assert not list((tmp_path / "spill").glob(".*.spill"))


def test_a_spilling_sink_holds_what_is_in_flight_not_what_the_run_did(tmp_path):
    """A server under a budget serves request after request: what the sink keeps in memory between spills
    (flows waiting for an end, spans a link may name, links waiting for a span) stays the same size after
    3000 requests as after 300, and the trace it writes still pairs every flow and resolves every link."""
    sink = TraceSink("1x02", TraceConfig(dir=str(tmp_path), spill_events=64), 1000)
    for pid, name in ((1, "scheduler"), (2, "draft"), (3, "verifier")):
        sink.name_process(pid, name)
    held = []
    for round_ in range(1500):
        sched, draft, verifier = Tracer(), Tracer(), Tracer()
        src, dst = 2 * round_ + 1, 2 * round_ + 2
        for req in (src, dst):
            with sched.span("send", cat="scheduler", args={"req": req, "to": "x"}, flow_out=req):
                pass
        with draft.span("build", cat="draft", args={"req": src}, flow_in=src):
            pass
        sink.add(1, sched.drain())
        sink.add(2, draft.drain())
        sink.link((2, src), (3, dst), "draft tree", "tree")  # made before the verifier's span arrives
        with verifier.span("verify", cat="verifier", args={"req": dst}, flow_in=dst):
            pass
        sink.add(3, verifier.drain())
        if round_ in (149, 1499):
            held.append(len(sink._served) + len(sink._flows.open) + len(sink._flows.bad) + len(sink._links))
    assert held[1] <= held[0] + 8, held  # not ten times as much after ten times the requests
    obj = json.loads(sink.write().read_text())
    assert validate_trace(obj) == [] and obj["otherData"]["unpaired_flow_events"] == 0
    evs = obj["traceEvents"]
    assert sum(1 for e in evs if e["ph"] == "s" and e.get("cat") == "tree") == 1500  # every link resolved
    assert sum(1 for e in evs if e["ph"] == "f" and e.get("cat") != "tree") == 3000  # every request's flow


def test_a_run_sweeps_the_spill_files_of_runs_killed_outright(tmp_path):
    """A run killed outright (SIGKILL: the OOM killer, `kill -9`, a cgroup torn down) cannot remove its trace's
    spill file; the next run that traces to that folder does, and leaves a live run's and anything else alone."""
    import os
    import subprocess
    import sys

    d = tmp_path / "traces"
    d.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = [d / f".{dead.pid}x0a0b0c.spill", d / f"{dead.pid}x0a0b0c.json.tmp"]  # a spill, a trace half written
    kept = [d / f".{os.getpid()}x0d0e0f.spill", d / f"{os.getpid()}x0d0e0f.json.tmp", d / "notes.spill"]
    for f in stale + kept:
        f.write_text('{"ph":"X"}\n')
    with Runtime(small_config(d)) as s:
        assert not any(f.exists() for f in stale) and all(f.exists() for f in kept)
    assert (d / f"{s.run_id}.json").exists()
