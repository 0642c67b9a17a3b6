"""The scheduler with all four fake actors: pipeline order, the loader's memory bound, a SIGKILL
of each role at a random point, the scheduler itself SIGKILLed, Ctrl-C, and a stress test.
After every fault: no /dev/shm segment of the run, no orphan process, one line naming the role."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import zlib

import numpy as np
import pytest

from actors.fake import FAKES
from scheduler.config import KiB, MiB, MemoryConfig
from scheduler.errors import ActorDead
from scheduler.pipeline import run_pipeline
from scheduler.runtime import ReplyEvent, Scheduler
from scheduler.trace import validate_trace
from shm.desc import TensorDesc
from shm.watchdog import REPO_ROOT, python_env
from tests.runtime.conftest import alive, assert_clean, wait_until
from tests.runtime.fake_run import policy_for, small_config, spawn_fakes

ROLES = ("draft", "verifier", "sparse", "loader")


def test_pipeline_order_and_the_loaders_memory_bound(seed):
    with Scheduler(small_config(max_tokens=32)) as s:
        pids = spawn_fakes(s, seed)
        policy = policy_for(s)
        result = run_pipeline(s, policy)
        loader = s.call("loader", "stats").result
        bound = s.config.memory.stream_bytes
        assert result.tokens >= 32
        # the bound held: the allocator, the policy, and where the loader actually wrote
        assert result.peak_stream_bytes <= bound and policy.peak_held <= bound
        assert loader["max_end"] <= bound and loader["region"] == bound
        assert loader["bytes_written"] > 4 * bound  # every slot was reused many times...
        assert s.stream_slots.used_bytes == 0  # ...and all came back
        # (the verifier and sparse worker check every slot's stamp: a reuse before release would have failed)
        done = {(r, a.get("seq")): t for t, kind, r, _, a in result.timeline if kind == "done"}
        verifies = [(t, a["seq"]) for t, kind, r, _, a in result.timeline if kind == "send" and r == "verifier"]
        assert [q for _, q in verifies] == list(range(len(verifies)))
        assert all(t >= done[("loader", q)] for t, q in verifies), "a layer was verified before it was loaded"
        busy = {"draft": [], "verifier": []}
        start = {}
        for t, kind, r, _, a in result.timeline:
            if r in busy:
                if kind == "send":
                    start[r] = t
                else:
                    busy[r].append((start.pop(r), t))
        assert not [1 for d0, d1 in busy["draft"] for v0, v1 in busy["verifier"] if d0 < v1 and v0 < d1], \
            "draft and verifier computed at once on a shared unit"
    assert_clean(s.run_id, list(pids.values()))


@pytest.mark.parametrize("role", ROLES)
def test_each_role_sigkilled_at_a_random_point(role, seed, tmp_path):
    delay = random.Random(f"{seed}:{role}").uniform(0.0, 1.2)
    print(f"killing the {role} actor {delay:.3f} s after spawn")
    s = Scheduler(small_config(tmp_path, max_tokens=10**9))
    with pytest.raises(ActorDead) as e:
        with s:
            for r in ROLES:
                s.spawn(r, FAKES[r], {"seed": seed, "stream_bytes": s.config.memory.stream_bytes}, wait=False)
            pids = [p.pid for p in s.actors.values()]
            victim = s.actors[role].pid
            threading.Timer(delay, os.kill, (victim, signal.SIGKILL)).start()
            s.wait_ready()
            run_pipeline(s, policy_for(s))
    assert str(e.value) == f"the {role} actor was killed by SIGKILL" and e.value.role == role
    assert_clean(s.run_id, pids)
    assert validate_trace(json.loads(s.trace_path.read_text())) == []  # a run that died still leaves a valid trace


def test_a_killed_zygote_costs_nothing_but_a_new_one_for_the_next_spawn(seed):
    """The actors fork from the zygote but are the scheduler's own children: its death mid-run stops
    nothing; the next spawn starts a new zygote; all of them are gone at the end."""
    with Scheduler(small_config(max_tokens=16)) as s:
        s.spawn("verifier", FAKES["verifier"], {"seed": seed, "stream_bytes": s.config.memory.stream_bytes})
        first = s.zygote_pid
        os.kill(first, signal.SIGKILL)
        assert wait_until(lambda: not alive(first), 3.0)
        assert s.call("verifier", "stats").ok  # the actor it forked runs on
        pids = spawn_fakes(s, seed, roles=("draft", "sparse", "loader"))
        assert s.zygote_pid not in (None, first)
        result = run_pipeline(s, policy_for(s))
        assert result.tokens >= 16
        zygotes = [first, s.zygote_pid]
    assert_clean(s.run_id, [*pids.values(), s.actors["verifier"].pid, *zygotes])


def _start_fake_run(seed: int, **popen) -> tuple[subprocess.Popen, dict]:
    env = {**python_env(), "CADENCE_TEST_SEED": str(seed)}
    p = subprocess.Popen([sys.executable, "-m", "tests.runtime.fake_run"], cwd=REPO_ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)
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
    assert took < 1.5, f"actors outlived their scheduler by {took:.2f} s"  # the bound is 1 s; slack for a shared machine
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
    assert f"run {info['run_id']} interrupted (Ctrl-C); stopping draft, verifier, sparse, loader" in err, err
    assert "Traceback" not in err


def test_stress_random_sizes_and_sleeps_across_processes(seed):
    """Random tensors from 1 B to 2 MiB, up to 8 requests in flight over three actors, random
    sleeps; every input slot is freed right after sending, so only the lease keeps it alive."""
    rng = random.Random(seed)
    cfg = small_config()
    cfg = type(cfg)(**{**cfg.__dict__, "memory": MemoryConfig(budget_bytes=cfg.memory.budget_bytes, arena_bytes=12 * MiB,
                                                              stream_bytes=256 * KiB, sample_s=0.2)})
    with Scheduler(cfg) as s:
        pids = spawn_fakes(s, seed, roles=("draft", "verifier", "sparse"))
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
                arena[src.offset:src.offset + n] = data
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
                assert ev.reply.result["crc"] == want == zlib.crc32(arena[out.offset:out.offset + n]), f"seed {seed}"
                s.slots.free(out)
                done += 1
        assert s.slots.used_bytes == 0 and s.slots.peak_bytes <= s.slots.capacity
    assert_clean(s.run_id, list(pids.values()))
