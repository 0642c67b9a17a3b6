"""One actor under a real scheduler: handshake, each timeout, errors, deaths, malformed frames."""

from __future__ import annotations

import os
import random
import signal
import zlib

import msgpack
import psutil
import pytest
import torch

from actors import wire
from tests.runtime.fakes.actors import FakeLoaderActor
from tests.runtime.fakes.target import FakeDraftActor
from scheduler.remote import Remote
from common.errors import CadenceError
from scheduler.procs import SPIN_TURNS
from scheduler.errors import ActorDead, ActorError, RequestTimeout
from scheduler.runtime import Runtime
from scheduler.events import DeadEvent, ErrorEvent
from tests.runtime.conftest import assert_clean, wait_until
from tests.runtime.fake_run import small_config

T = "tests.runtime.actors_for_tests"


def run(config=None, **timeouts):
    return Runtime(config or small_config(**timeouts))


def test_handshake_ping_and_clean_exit():
    with run() as s:
        proc = s.spawn("draft", FakeDraftActor, {"seed": 1})
        assert proc.actor == "FakeDraftActor" and "cycle" in proc.ops and "ping" in proc.ops
        assert s.call("draft", "ping", {"x": [1, "two"]}).result == {"x": [1, "two"]}
        draft = Remote(s, "draft")
        draft.start(prompt_ids=[1, 2], capacity=12, first=3)
        assert len(draft.cycle(cycles=[{"budget": 4}]).trees[0]["tokens"]) == 4
    assert proc.popen.returncode == 0  # it stopped when asked, it was not killed
    assert proc.said == "stopped when asked"  # its last word, after its last trace batch, was waited for
    assert_clean(s.run_id, [proc.pid])


def test_failed_op_answers_the_caller_and_the_actor_keeps_serving():
    with run() as s:
        s.spawn("draft", FakeDraftActor)
        with pytest.raises(ActorError, match=r"the draft actor failed 'fail' \(request \d+\): ValueError: bad weights"):
            s.call("draft", "fail", {"message": "bad weights"})
        with pytest.raises(ActorError, match="has no op 'nope'; it serves .*cycle"):
            s.call("draft", "nope")
        with pytest.raises(ActorError, match="op 'cycle' takes cycles: unknown argument\\(s\\) width"):
            s.call("draft", "cycle", {"width": 4})  # an argument the op does not take (actors/calls.py)
        with pytest.raises(ActorError, match="a draft cycle: argument 'budget' must be int, got str"):
            s.call("draft", "cycle", {"cycles": [{"budget": "four"}]})  # a cycle's field, checked as it arrives
        with pytest.raises(ActorError, match="a draft cycle takes .*: unknown argument\\(s\\) width"):
            s.call("draft", "cycle", {"cycles": [{"width": 4}]})
        assert s.call("draft", "ping").ok
    assert_clean(s.run_id)


def test_fatal_error_arrives_as_a_dead_frame():
    with run() as s:
        pid = s.spawn("draft", FakeDraftActor).pid
        with pytest.raises(ActorDead, match="^the draft actor gave up: the GPU fell off$") as e:
            s.call("draft", "give_up", {"message": "the GPU fell off"})
        assert e.value.role == "draft"
        with pytest.raises(ActorDead, match="gave up"):
            s.call("draft", "ping")  # later calls get the same reason
    assert_clean(s.run_id, [pid])


def test_setup_failure_names_role_and_cause():
    with run() as s:
        with pytest.raises(
            ActorDead, match="^the broken actor failed during setup: RuntimeError: weights file is truncated$"
        ):
            s.spawn("broken", f"{T}:BrokenSetupActor")
    assert_clean(s.run_id)


@pytest.mark.parametrize(
    "path, match",
    [
        (f"{T}:Missing", "could not load class .*AttributeError"),
        (f"{T}:NotAnActor", "could not load class .*not an Actor subclass"),
        ("no_such_module:X", "could not load class .*ModuleNotFoundError"),
    ],
)
def test_bad_class_path(path, match):
    with run() as s:
        with pytest.raises(ActorDead, match=match):
            s.spawn("x", path)
    assert_clean(s.run_id)


def test_hello_timeout_names_its_setting(monkeypatch):
    monkeypatch.setenv("CADENCE_TEST_IMPORT_SLEEP", "30")
    with run(hello_s=0.5) as s:
        with pytest.raises(
            ActorDead, match=r"^the slow actor did not send HELLO within 0.5 s \(raise timeouts.hello_s\)$"
        ):
            s.spawn("slow", f"{T}:SlowSetupActor")
        pid = s.actors["slow"].pid
    assert_clean(s.run_id, [pid])


def test_init_timeout_names_its_setting():
    with run(init_s=0.5) as s:
        with pytest.raises(
            ActorDead, match=r"^the slow actor did not answer INIT within 0.5 s \(raise timeouts.init_s\)$"
        ):
            s.spawn("slow", f"{T}:SlowSetupActor", {"sleep_s": 30})
        pid = s.actors["slow"].pid
    assert_clean(s.run_id, [pid])


def test_ready_timeout_names_its_setting():
    with run(ready_s=0.5) as s:
        s.spawn("draft", FakeDraftActor, wait=False)
        s.wait_ready(["draft"], timeout=30)  # the machine may be busy: only `slow` should miss 0.5 s
        s.spawn("slow", f"{T}:SlowSetupActor", {"sleep_s": 30}, wait=False)
        with pytest.raises(
            CadenceError, match=r"the slow actor\(s\) were not READY within 0.5 s \(raise timeouts.ready_s\)"
        ):
            s.wait_ready()
        pids = [p.pid for p in s.actors.values()]
    assert_clean(s.run_id, pids)


def test_request_timeout_names_its_setting_and_the_actor_survives():
    with run() as s:
        s.spawn("draft", FakeDraftActor)
        with pytest.raises(
            RequestTimeout,
            match=r"^the draft actor did not answer 'sleep' \(request \d+\) within 0.2 s \(raise timeouts.request_s\)$",
        ):
            s.call("draft", "sleep", {"s": 0.6}, timeout=0.2)
        assert s.call("draft", "ping", {"after": 1}).result == {"after": 1}  # the late reply was dropped
    assert_clean(s.run_id)


def test_hung_actor_is_killed_after_heartbeat_timeout():
    with run(heartbeat_s=0.6) as s:
        pid = s.spawn("draft", FakeDraftActor).pid
        s.send("draft", "sleep", {"s": 30})
        deaths = []
        assert wait_until(lambda: deaths.extend(e for e in s.poll(0.1) if isinstance(e, DeadEvent)) or deaths, 10)
        assert deaths[0].role == "draft"
        assert "sent nothing for 0.6 s, so it was killed as hung (raise timeouts.heartbeat_s" in str(deaths[0].error())
    assert_clean(s.run_id, [pid])


def test_a_long_step_that_beats_is_not_hung():
    with run(heartbeat_s=0.6) as s:
        s.spawn("draft", FakeDraftActor)
        assert s.call("draft", "sleep", {"s": 1.5, "beats": 10}).ok  # 1.5 s > heartbeat_s, beating every 0.15 s
    assert_clean(s.run_id)


def test_sigkill_is_seen_by_the_sentinel():
    with run() as s:
        pid = s.spawn("draft", FakeDraftActor).pid
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(ActorDead, match="^the draft actor was killed by SIGKILL$"):
            for _ in range(100):
                s.call("draft", "ping")
    assert_clean(s.run_id, [pid])


def test_sigterm_stops_an_actor_with_a_reason():
    with run() as s:
        pid = s.spawn("draft", FakeDraftActor).pid
        os.kill(pid, signal.SIGTERM)
        deaths = []
        assert wait_until(lambda: deaths.extend(e for e in s.poll(0.1) if isinstance(e, DeadEvent)) or deaths, 5)
        assert str(deaths[0].error()) == "the draft actor stopped on SIGTERM"
    assert_clean(s.run_id, [pid])


def _malformed(rng: random.Random) -> list[bytes]:
    kind = rng.randrange(6)
    if kind == 0:  # random frames
        return [rng.randbytes(rng.randrange(0, 40)) for _ in range(rng.choice([1, 3, 4]))]
    if kind == 1:  # a known type with a garbage body
        return [bytes([rng.choice(list(wire.TYPES))]), rng.randbytes(rng.randrange(0, 60))]
    if kind == 2:  # a truncated valid request
        frames = wire.encode(wire.Request("ping", {"k": "v" * 20}, {}, 1, None))
        return [frames[0], frames[1][: rng.randrange(len(frames[1]))]]
    if kind == 3:  # valid msgpack, wrong fields or types
        body = {"op": rng.choice([1, None, "ping"]), "args": rng.choice([{}, [], "x"]), "req_id": rng.randrange(10)}
        return [bytes([wire.Request.TYPE]), msgpack.packb(body)]
    if kind == 4:  # a valid message the actor does not expect
        msg = rng.choice(
            [
                wire.Hello("x", 1),
                wire.Ready("x", "X", []),
                wire.Heartbeat(1),
                wire.Dead("x", "y"),
                wire.Reply(1, True, {}, {}, None),
                wire.Init({}, [], 0, 1.0, False),
            ]
        )
        return wire.encode(msg)
    return [bytes([rng.randrange(256)]), msgpack.packb(rng.random())]  # a float body, maybe an unknown type


def test_1000_malformed_frames_get_1000_errors_and_the_actor_keeps_serving(seed):
    rng = random.Random(seed)
    with run() as s:
        s.spawn("draft", FakeDraftActor)
        for _ in range(1000):
            s.send_raw("draft", _malformed(rng))
        errors = []
        assert wait_until(
            lambda: errors.extend(e for e in s.poll(0.1) if isinstance(e, ErrorEvent)) or len(errors) >= 1000, 30
        )
        assert len(errors) == 1000 and all(e.role == "draft" and e.message for e in errors)
        assert s.call("draft", "ping", {"still": "here"}).result == {"still": "here"}
        assert s.call("draft", "stats").result["bad_frames"] == 1000
    assert_clean(s.run_id)


def test_tensors_in_requests_are_leased_until_the_reply():
    with run() as s:
        s.spawn("loader", FakeLoaderActor, {"stream_bytes": s.config.memory.stream_bytes})
        data = torch.randint(0, 255, (100_000,), dtype=torch.uint8)
        src, desc = s.put(data)
        out = s.slots.alloc(data.numel())
        rid = s.send("loader", "transform", {"crc": zlib.crc32(data.numpy())}, {"x": desc, "out": s.slot_desc(out)})
        assert s.slots.leases(src) == {"loader": 1} and s.slots.leases(out) == {"loader": 1}
        s.slots.free(src)
        reply = [e for e in s.poll(5) if hasattr(e, "reply")][0].reply
        assert reply.ok and reply.req_id == rid
        assert s.slots.leases(out) == {} and s.slots.used_bytes == out.nbytes  # src came back once released
        assert torch.equal(s.view(s.slot_desc(out))[: data.numel()], data.flip(0))
        # a torch tensor goes in by itself: one copy into a slot that returns after the reply
        big = torch.arange(1000, dtype=torch.uint8)
        s.call("loader", "transform", {"crc": zlib.crc32(big.numpy())}, {"x": big, "out": s.slot_desc(out)})
        assert s.slots.used_bytes == out.nbytes
    assert_clean(s.run_id)


def test_scheduler_answers_malformed_frames_from_an_actor_and_keeps_serving():
    with run() as s:
        s.spawn("spam", f"{T}:SpammingActor")
        assert s.call("spam", "spam", {"n": 100}).result == {"sent": 100}
        assert wait_until(lambda: s.call("spam", "stats").result["errors_received"] == 100, 10)  # each was answered
        assert s.pump.bad_frames == 100 and s.call("spam", "ping").ok
    assert_clean(s.run_id)


def test_shutdown_kills_the_tree_of_an_actor_that_does_not_stop():
    with run() as s:
        proc = s.spawn("tree", f"{T}:TreeActor")
        grandchild = s.call("tree", "child").result["pid"]
        s.send("tree", "sleep", {"s": 60})  # busy: it will not see STOP
    assert proc.popen.returncode == -signal.SIGKILL  # asked, waited timeouts.shutdown_s, then killed
    assert_clean(s.run_id, [proc.pid, grandchild])


def test_replies_the_wire_cannot_carry_fail_the_request_not_the_actor():
    with run() as s:
        s.spawn("sloppy", f"{T}:SloppyActor")
        with pytest.raises(ActorError, match="op 'number' returned int, dict; return a result dict"):
            s.call("sloppy", "number")
        with pytest.raises(
            ActorError,
            match="op 'object' returned something the wire cannot carry: cannot encode Reply: object is not msgpack-able",
        ):
            s.call("sloppy", "object")
        assert s.call("sloppy", "ping").ok
    assert_clean(s.run_id)


@pytest.mark.parametrize(
    "env,want",
    [({}, SPIN_TURNS), ({"GOMP_SPINCOUNT": "123"}, "123"), ({"OMP_WAIT_POLICY": "active"}, None)],
    ids=["ours", "user-spincount", "user-policy"],
)
def test_actors_spin_briefly_unless_the_user_said(monkeypatch, env, want):
    """An idle actor's OpenMP threads must not hold a core for milliseconds while another actor computes
    (scheduler/procs.py, SPIN_TURNS); what the user set about OpenMP's waiting stands."""
    for k in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with run() as s:
        proc = s.spawn("draft", FakeDraftActor)
        seen = psutil.Process(proc.pid).environ()
    assert seen.get("GOMP_SPINCOUNT") == want
    assert seen.get("OMP_WAIT_POLICY") == env.get("OMP_WAIT_POLICY")
