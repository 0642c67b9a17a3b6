"""The memory wall on the real pair: the 1.5B target streamed under a budget, lossless, bounded, clean.

A handful of dev prompts (one of each kind) and a few dozen tokens: streaming re-reads the target
from disk for every forward, so these runs are slow by design.
"""

import json
import time

import psutil
import pytest

from common import paths
from common.errors import CadenceError
from engine.prompts import Prompt, encode_prompt
from engine.runner import Runner
from engine.config import RunConfig
from common.settings import SamplingConfig
from scheduler.errors import ActorDead
from speculative.generate import generate_target
from tests.launch.conftest import launch
from tests.conftest import dev_prompts, door_kv_dtype, kv_dtype_of, real_model, run_until_role_killed, shm_segments

pytestmark = [pytest.mark.real, pytest.mark.slow]
N = 16
IDS = ("fib", "explain")  # code and prose; tests/scheduler/test_lean_runtime.py runs each mode in a cgroup too


def _prompts():
    return [Prompt(p["id"], p["kind"], p["prompt"]) for p in dev_prompts() if p["id"] in IDS]


@pytest.fixture(scope="module")
def reference():
    target = real_model("qwen2.5-coder-1.5b", "int4")
    out = {}
    with kv_dtype_of((target,), door_kv_dtype()):  # the target alone with the caches a run's door writes
        for p in _prompts():
            ids, _ = encode_prompt(target.tokenizer, p, "auto")
            out[p.id] = generate_target(target, ids, N, SamplingConfig()).new_ids
    return out


def _cfg(mode, tmp_path, budget="auto"):
    return RunConfig.from_options(
        target="qwen2.5-coder-1.5b",
        draft="qwen2.5-coder-0.5b",
        dtype="int4",
        mode=mode,
        max_new_tokens=N,
        draft_ahead="4",
        memory_budget=budget,
        trace_dir=str(tmp_path),
    )


def test_every_mode_under_the_budget_equals_the_resident_target(reference, tmp_path):
    before = shm_segments()
    cfg = _cfg("tree", tmp_path)
    with Runner(cfg) as runner:
        plan = runner.plan.memory
        assert plan.streamed and plan.n_slots >= 2  # the target really streams
        ahead_steps = 0
        for mode in ("tree", "chain", "stdpl", "std"):
            # the target-only modes step a token a forward, the slowest by design: one prompt shows each
            # lossless (std differs from stdpl only in not prefetching: the same loads, the same compute)
            for p in _prompts()[:1] if mode in ("std", "stdpl") else _prompts():
                row = runner.run(p, mode=mode).row
                assert row["new_token_ids"] == reference[p.id], (mode, p.id)
                assert row["memory_budget_bytes"] == plan.budget
                assert row["stats"]["loads"] > 0 and row["stats"]["bytes_read"] > 0
                if mode in ("tree", "chain") and row["stats"]["verifications"]:  # drafting during verification
                    ahead_steps += row["stats"]["ahead_steps"]
                if mode in ("tree", "chain"):  # a forward is a read whatever its rows: none spent on a token alone
                    arms = row["stats"]["arm_hist"]  # (but the last, where one token was left to write)
                    assert "lookup" not in arms and arms.get("plain", 0) <= 1, arms
        assert ahead_steps > 0
        sched = runner.sched
        loader = sched.call("loader", "stats").result
        runner.session.target.close()  # waits for prefetched loads and gives their slots back
        assert loader["max_end"] <= plan.stream_bytes  # the loader never wrote past its part of the arena
        assert sched.stream_slots.peak_bytes <= plan.stream_bytes
        assert sched.stream_slots.used_bytes == 0  # every slot released
    assert shm_segments() <= before


def test_a_killed_loader_ends_the_run_with_a_reason_and_no_leak(tmp_path):
    before = shm_segments()
    with pytest.raises(ActorDead, match="loader"):
        run_until_role_killed(_cfg("stdpl", tmp_path), "loader", 3.0, _prompts(), 10)
    time.sleep(0.5)
    assert shm_segments() <= before
    assert not [
        c
        for c in psutil.Process().children(recursive=True)
        if c.is_running() and c.status() != psutil.STATUS_ZOMBIE and "actors" in " ".join(c.cmdline())
    ]


def test_a_budget_too_small_is_refused_before_anything_starts(tmp_path):
    before = shm_segments()
    with pytest.raises(CadenceError, match="too small.*smallest budget that works is"):
        Runner(_cfg("tree", tmp_path, budget="600MiB"))
    assert shm_segments() <= before


@pytest.mark.parametrize("budget", ["520MiB", "460MiB"])
def test_a_budget_too_small_for_the_auto_draft_takes_it_lean_or_the_trie_and_says_why(budget, tmp_path):
    """`--draft auto` picked the 0.5B draft, and the budget holds the target's plan but not the int4 draft beside
    it: at 520 MiB the draft runs in the model format int2 (its FFN in 2 bits); at 460 MiB not even that fits and
    the n-gram trie proposes alone. Either way the default command runs, says so in one line, and is lossless.
    `launch run` in a process of its own, as a user runs it (this one holds the reference model)."""
    p = _prompts()[0]
    out = tmp_path / "rows.json"
    argv = ["run", "--prompt", p.text, "--chat", "off", "--memory-budget", budget, "--max-new-tokens", "8"]
    run = launch(*argv, "--no-monitor", "--no-trace", "--json", str(out), home=paths.home(), check=True)
    row = json.loads(out.read_text())[0]
    target = real_model("qwen2.5-coder-1.5b", "int4")
    ids, _ = encode_prompt(target.tokenizer, p, "off")
    with kv_dtype_of((target,), door_kv_dtype()):
        assert row["new_token_ids"] == generate_target(target, ids, 8, SamplingConfig()).new_ids
    assert row["mode"] == "tree" and row["memory_budget_bytes"] == int(budget[:-3]) << 20
    (line,) = [s for s in run.stderr.splitlines() if s.startswith("draft: ")]
    if budget == "520MiB":
        assert row["draft"] == "qwen2.5-coder-0.5b" and row["stats"]["verifications"] > 0
        assert line.startswith("draft: qwen2.5-coder-0.5b int2 (its FFN in 2 bits") and "--draft-dtype" in line
    else:
        assert row["draft"] is None
        assert line.startswith("draft: none") and "qwen2.5-coder-0.5b, even in int2" in line
        assert "smallest budget that works is" in line and "--draft NAME" in line
