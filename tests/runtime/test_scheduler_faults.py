"""Faults in the scheduler `launch run` uses (`ActorSession` with the fake actors): each role
SIGKILLed at a scripted point, an op that fails, an actor that hangs, the zygote killed, the scheduler
itself SIGKILLed or Ctrl-C'd; and a stress test of the arena across processes. After every fault: one
error naming the role, no /dev/shm segment of the run, no orphan process."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import zlib

import numpy as np
import pytest

from tests.runtime.fakes.actors import FAKES, target_text
from common.settings import WorkerSplit
from scheduler.runtime_config import KiB, MiB, MemoryConfig
from scheduler.errors import ActorDead, ActorError, RequestTimeout
from scheduler.runtime import Runtime
from scheduler.events import ReplyEvent
from scheduler.trace import validate_trace
from shm.desc import TensorDesc
from shm.watchdog import REPO_ROOT, python_env
from tests.runtime.conftest import alive, assert_clean, wait_until
from tests.runtime.fake_run import VOCAB, fake_model, fake_plan, prompt, small_config, speculation

# where each role is hit: the op it serves most in a streamed tree run with the worker
OPS = {"verifier": "layer", "draft": "cycle", "loader": "load", "sparse": "serve"}
WORKER = WorkerSplit(0.3, 0.2)


def _run_all_four(tmp_path, script: dict, seed: int, trace: bool = False, **timeouts):
    """A streamed tree run with all four fakes, one role scripted: (the scheduler, the error it ended
    with, the actors' pids, the seconds the generation ran)."""
    plan = fake_plan()
    s = Runtime(small_config(tmp_path / "traces" if trace else None, plan, **timeouts))
    pids, t0 = [], time.monotonic()
    try:
        with s:
            spec = speculation(s, fake_model(tmp_path / "model", seed, **script), "tree", plan, worker=WORKER)
            pids = [a.pid for a in s.actors.values()]
            t0 = time.monotonic()
            try:
                spec.loop.generate(prompt(seed=seed), 400, set())
            finally:
                if not any(r.get("hang_at") for r in script.values()):  # a hung loader's loads never drain
                    spec.close()
    except Exception as e:
        return s, e, pids, time.monotonic() - t0
    return s, None, pids, time.monotonic() - t0


@pytest.mark.parametrize("role", list(OPS))
def test_each_role_sigkilled_at_a_scripted_point(role, seed, tmp_path):
    n = random.Random(f"{seed}:{role}").randint(1, 4)
    print(f"the {role} actor kills itself at its request {n} of {OPS[role]!r}")
    s, e, pids, _ = _run_all_four(tmp_path, {role: {"die_at": {OPS[role]: n}}}, seed, trace=True)
    assert isinstance(e, ActorDead) and e.role == role, e
    assert str(e) == f"the {role} actor was killed by SIGKILL"
    assert_clean(s.run_id, pids)
    assert validate_trace(json.loads(s.trace_path.read_text())) == []  # a run that died still leaves a valid trace


@pytest.mark.parametrize("role", list(OPS))
def test_an_op_that_fails_is_one_actor_error(role, seed, tmp_path):
    s, e, pids, _ = _run_all_four(tmp_path, {role: {"fail_at": {OPS[role]: 2}}}, seed)
    assert isinstance(e, ActorError) and (e.role, e.op) == (role, OPS[role]), e
    assert "scripted failure" in str(e) and f"the {role} actor failed {OPS[role]!r}" in str(e)
    assert_clean(s.run_id, pids)


@pytest.mark.parametrize("role", list(OPS))
def test_a_hung_actor_times_out(role, seed, tmp_path):
    """It keeps heartbeating, so only the request's own timeout (timeouts.request_s) can tell."""
    s, e, pids, took = _run_all_four(tmp_path, {role: {"hang_at": {OPS[role]: 2}}}, seed, request_s=1.0, shutdown_s=0.3)
    if role == "sparse":  # the verifier waits for the worker's step in the sync area, with the same deadline
        assert isinstance(e, ActorError) and e.role == "verifier" and "the sparse worker did not finish" in str(e), e
        assert "within 0.8 s" in str(e)  # before the scheduler's own 1 s: the sentence names the worker
    else:
        assert isinstance(e, RequestTimeout) and (e.role, e.op) == (role, OPS[role]), e
        assert str(e).endswith("within 1 s (raise timeouts.request_s)")
    assert 1.0 <= took < 3.0, f"the timeout of 1 s took {took:.2f} s"
    assert_clean(s.run_id, pids)


def test_a_killed_zygote_costs_nothing_but_a_new_one_for_the_next_spawn(seed, tmp_path):
    """The actors fork from the zygote but are the scheduler's own children: its death mid-run stops
    nothing; the next spawn starts a new zygote; all of them are gone at the end."""
    with Runtime(small_config()) as s:
        spec = speculation(s, fake_model(tmp_path, seed), "tree")
        first = s.zygote_pid
        os.kill(first, signal.SIGKILL)
        assert wait_until(lambda: not alive(first), 3.0)
        assert spec.loop.generate(prompt(seed=seed), 30, set()).new_ids == target_text(prompt(seed=seed), 30, VOCAB)
        s.spawn("extra", FAKES["loader"])
        assert s.zygote_pid not in (None, first)
        pids = [a.pid for a in s.actors.values()]
        zygotes = [first, s.zygote_pid]
    assert_clean(s.run_id, [*pids, *zygotes])


def _start_fake_run(seed: int, **popen) -> tuple[subprocess.Popen, dict]:
    env = {**python_env(), "CADENCE_TEST_SEED": str(seed)}
    p = subprocess.Popen(
        [sys.executable, "-m", "tests.runtime.fake_run"],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )
    line = p.stdout.readline()
    assert line, f"fake_run did not start: {p.stderr.read()}"
    return p, json.loads(line)


def test_scheduler_sigkilled_leaves_nothing_behind(seed):
    p, info = _start_fake_run(seed)
    actors = list(info["pids"].values())
    time.sleep(random.Random(seed).uniform(0.1, 0.6))  # mid-pipeline
    p.kill()
    t0 = time.monotonic()
    p.wait()
    assert wait_until(lambda: not any(alive(a) for a in actors), 3.0)
    took = time.monotonic() - t0
    assert took < 1.5, (
        f"actors outlived their scheduler by {took:.2f} s"
    )  # the bound is 1 s; slack for a shared machine
    assert_clean(info["run_id"], actors + [info["watchdog"], info["zygote"]], timeout=5.0)
    _, err = p.communicate(timeout=5)
    line = f"cadence watchdog: the scheduler (pid {info['pid']}) of run {info['run_id']} died without cleaning up"
    assert line in err, err


def _as_in_a_terminal():
    """Its own process group with Ctrl-C's default action, as in a terminal: a shell that runs the
    tests in the background hands its children SIGINT ignored, and Python then never raises
    KeyboardInterrupt."""
    os.setsid()
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_stops_the_whole_run(seed):
    p, info = _start_fake_run(seed, preexec_fn=_as_in_a_terminal)
    try:
        _ctrl_c_stops(p, info, seed)
    finally:
        if p.poll() is None:  # never leave the run behind a failed assertion
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _ctrl_c_stops(p, info, seed):
    actors = list(info["pids"].values())
    time.sleep(random.Random(seed).uniform(0.1, 0.6))
    os.killpg(p.pid, signal.SIGINT)  # what Ctrl-C does: the whole foreground group gets SIGINT
    t0 = time.monotonic()
    p.wait(timeout=10)
    assert wait_until(lambda: not any(alive(a) for a in actors), 3.0)
    took = time.monotonic() - t0
    assert took < 3.0, f"Ctrl-C took {took:.2f} s to stop the run"  # the bound is 2 s
    assert p.returncode == 130
    assert_clean(info["run_id"], actors + [info["watchdog"], info["zygote"]])
    _, err = p.communicate(timeout=5)
    assert f"run {info['run_id']} interrupted (Ctrl-C); stopping sparse, loader, verifier, draft" in err, err
    assert "Traceback" not in err


def test_stress_random_sizes_and_sleeps_across_processes(seed):
    """Random tensors from 1 B to 2 MiB, up to 8 requests in flight over three actors, random
    sleeps; every input slot is freed right after sending, so only the lease keeps it alive."""
    rng = random.Random(seed)
    cfg = small_config()
    cfg = type(cfg)(
        **{
            **cfg.__dict__,
            "memory": MemoryConfig(
                budget_bytes=cfg.memory.budget_bytes, arena_bytes=12 * MiB, stream_bytes=256 * KiB, sample_s=0.2
            ),
        }
    )
    with Runtime(cfg) as s:
        for role in ("draft", "verifier", "sparse"):
            s.spawn(role, FAKES[role], {"seed": seed}, wait=False)
        s.wait_ready()
        pids = {role: p.pid for role, p in s.actors.items()}
        arena = np.frombuffer(s.arena.buf, dtype=np.uint8)
        inflight, done, sent = {}, 0, 0
        while done < 300:
            while len(inflight) < 8 and sent < 300:
                n = int(rng.choice([1, 7, 4096, 65_537, 2 * MiB]) * rng.random()) + 1
                src, out = s.slots.try_alloc(n), s.slots.try_alloc(n)
                if src is None or out is None:
                    for slot in (src, out):
                        if slot is not None:
                            s.slots.free(slot)
                    break  # full: wait for replies
                data = np.frombuffer(rng.randbytes(n), dtype=np.uint8)
                arena[src.offset : src.offset + n] = data
                role = rng.choice(("draft", "verifier", "sparse"))
                args = {"crc": zlib.crc32(data), "tag": sent, "max_sleep_s": rng.choice([0, 0.001, 0.005])}
                x = TensorDesc(s.arena.name, src.offset, "uint8", (n,), (1,))  # just the n bytes, not the whole slot
                rid = s.send(role, "transform", args, {"x": x, "out": s.slot_desc(out)})
                s.slots.free(src)  # ours is done; the actor's lease keeps it until the reply
                inflight[rid] = (out, zlib.crc32(data[::-1].copy()), n)
                sent += 1
            for ev in s.poll(1.0):
                assert isinstance(ev, ReplyEvent), f"seed {seed}: {ev}"
                assert ev.reply.ok, f"seed {seed}: {ev.reply.error}"
                out, want, n = inflight.pop(ev.reply.req_id)
                assert ev.reply.result["crc"] == want == zlib.crc32(arena[out.offset : out.offset + n]), f"seed {seed}"
                s.slots.free(out)
                done += 1
        assert s.slots.used_bytes == 0 and s.slots.peak_bytes <= s.slots.capacity
    assert_clean(s.run_id, list(pids.values()))
