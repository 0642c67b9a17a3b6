"""The hooks the monitor reads: event listeners, the actor table with current ops, the generation's
per-cycle callback and counters, and flows linking the spans of two requests."""

from __future__ import annotations

import json
import time

from tests.runtime.fakes.target import FakeDraftActor
from actors.tracing import Tracer
from scheduler.runtime_config import TraceConfig
from scheduler.events import DeadEvent, ReplyEvent
from scheduler.runtime import Runtime
from scheduler.trace import TraceSink, validate_trace
from tests.runtime.fake_run import fake_model, fake_plan, prompt, small_config, speculation


def test_listener_sees_events_and_actor_status_shows_the_current_op(tmp_path):
    seen = []
    with Runtime(small_config(None)) as s:
        s.spawn("draft", FakeDraftActor, {})
        s.add_listener(seen.append)
        s.add_listener(lambda ev: 1 / 0)  # a broken listener is dropped, the loop goes on
        [st] = s.actor_status()
        assert (st.role, st.pid, st.state, st.op, st.queued) == ("draft", s.actors["draft"].pid, "ready", None, 0)
        t0 = time.monotonic()
        req = s.send("draft", "sleep", {"s": 0.3})
        [st] = s.actor_status()
        assert st.op == "sleep" and t0 <= st.op_since <= time.monotonic() and st.queued == 1
        assert s.call("draft", "ping", {"x": 1}).result == {"x": 1}  # the sleep's reply arrives first
        assert [(type(e), e.op) for e in seen] == [(ReplyEvent, "sleep"), (ReplyEvent, "ping")]
        assert seen[0].reply.req_id == req and s.pump.listeners == [seen.append]
        assert [e.reply.req_id for e in s.poll(0)] == [req]  # listeners do not consume events
        [st] = s.actor_status()
        assert st.op is None and st.queued == 0
        s.remove_listener(seen.append)
        s.call("draft", "ping")
        assert len(seen) == 2
        s.add_listener(seen.append)
        s.actors["draft"].popen.kill()
        deadline = time.monotonic() + 5
        while not any(isinstance(e, DeadEvent) for e in seen) and time.monotonic() < deadline:
            s.poll(0.05)
        assert any(isinstance(e, DeadEvent) and e.role == "draft" for e in seen)
        assert s.actor_status()[0].state == "dead"


def test_generation_reports_each_cycle_and_writes_its_counters_and_tree_flows(tmp_path):
    cycles = []  # each step: (tokens committed, accepted, alpha); None, None for the prefill and plain steps
    plan = fake_plan()
    with Runtime(small_config(tmp_path / "traces", plan)) as s:
        spec = speculation(s, fake_model(tmp_path / "model", seed=5), "tree", plan, adaptive=False, trie=False)
        pids = {role: a.pid for role, a in s.actors.items()}
        try:
            gen = spec.loop.generate(
                prompt(), 30, set(), on_cycle=lambda st: cycles.append((len(st.tokens), st.accepted, st.alpha))
            )
        finally:
            spec.close()
    verified = [c for c in cycles if c[1] is not None]
    assert sum(n for n, _, _ in cycles) == len(gen.new_ids) and len(verified) == gen.stats["verifications"] > 0
    assert all(n == a + 1 for n, a, _ in verified[:-1])  # the accepted tokens and the target's own
    obj = json.loads(s.trace_path.read_text())
    assert validate_trace(obj) == [] and obj["otherData"]["unpaired_flow_events"] == 0
    evs = obj["traceEvents"]
    counter = lambda name: [e["args"] for e in evs if e["ph"] == "C" and e["name"] == name]
    totals = [sum(n for n, _, _ in cycles[: i + 1]) for i in range(1, len(cycles))]  # after each cycle but the prefill
    assert [c["total"] for c in counter("tokens")] == totals
    assert [c["alpha"] for c in counter("alpha")] == [alpha for _, _, alpha in verified]
    assert [c["length"] for c in counter("accepted")] == [a for _, a, _ in verified]
    assert all(c["length"] <= c["tree"] for c in counter("accepted"))
    tree = [e for e in evs if e["ph"] in "sf" and e["cat"] == "tree"]
    starts = [e for e in tree if e["ph"] == "s"]
    assert len(starts) == len(verified) and len(tree) == 2 * len(verified)  # one arrow per verified tree
    assert {e["pid"] for e in starts} == {pids["draft"]}
    assert {e["pid"] for e in tree if e["ph"] == "f"} == {pids["verifier"]}


def test_sink_links_the_spans_that_served_two_requests(tmp_path):
    sink = TraceSink("1x02", TraceConfig(dir=str(tmp_path)), 0)
    draft, verifier = Tracer(), Tracer()
    with draft.span("build", cat="draft", args={"req": 1}):
        pass
    time.sleep(0.001)
    with verifier.span("verify", cat="verifier", args={"req": 2}):
        pass
    sink.name_process(10, "draft")
    sink.name_process(20, "verifier")
    sink.add(10, draft.drain())
    sink.add(20, verifier.drain())
    sink.link((10, 1), (20, 2), "draft tree", "tree")
    sink.link((10, 1), (20, 99), "draft tree", "tree")  # its verification never arrived: left out
    sink.link((20, 2), (10, 1), "backwards", "tree")  # would end before it starts: left out
    obj = sink.to_json()
    assert validate_trace(obj) == []
    flows = [e for e in obj["traceEvents"] if e["ph"] in "sf"]
    assert [(e["ph"], e["pid"], e["name"]) for e in flows] == [("s", 10, "draft tree"), ("f", 20, "draft tree")]
