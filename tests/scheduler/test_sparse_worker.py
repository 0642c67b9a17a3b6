"""Hetero-core verification on the real pair: the sparse-attention actor takes the tree part of
attention (and a share of the dense chunks, and with a column share the last columns of every
linear layer); the output stays the target's, token for token."""

import json
import time

import pytest

from engine.prompts import Prompt, encode_prompt
from engine.runner import Runner
from engine.config import RunConfig
from common.settings import SamplingConfig
from scheduler.errors import ActorDead
from speculative.generate import generate_target
from tests.conftest import dev_prompts, door_kv_dtype, kv_dtype_of, real_model, run_until_role_killed, shm_segments

pytestmark = [pytest.mark.real, pytest.mark.slow]
N = 24


def _prompts():
    """One dev prompt of each kind: the worker's split is per layer and per step, so the kinds
    (chat, code, copy, ...) are what can tell a wrong split apart; the full set runs in the
    resident tree's lossless test."""
    seen, out = set(), []
    for p in dev_prompts():
        if p["kind"] not in seen:
            seen.add(p["kind"])
            out.append(Prompt(p["id"], p["kind"], p["prompt"]))
    return out


def _cfg(tmp_path, share, columns=0.0):
    return RunConfig.from_options(
        target="qwen2.5-coder-1.5b",
        draft="qwen2.5-coder-0.5b",
        dtype="int4",
        mode="tree",
        max_new_tokens=N,
        sparse_worker=True,
        worker_share=share,
        column_share=columns,
        trace_dir=str(tmp_path),
    )


@pytest.mark.parametrize(
    "share, columns, half", [(0.5, 0.0, 0), (0.25, 0.5, 1)], ids=["attention", "attention+columns"]
)
def test_tree_with_the_sparse_worker_is_lossless_on_each_kind_of_dev_prompt(tmp_path, share, columns, half):
    """Each split on half of the kinds (together: every kind once), to keep the suite's time."""
    target = real_model("qwen2.5-coder-1.5b", "int4")
    before = shm_segments()
    with Runner(_cfg(tmp_path, share, columns)) as runner:
        assert "sparse" in runner.sched.actors
        for p in _prompts()[half::2]:
            ids, _ = encode_prompt(target.tokenizer, p, "auto")
            with kv_dtype_of((target,), door_kv_dtype()):  # the caches the run's door writes
                ref = generate_target(target, ids, N, SamplingConfig()).new_ids
            row = runner.run(p).row
            assert row["new_token_ids"] == ref, p.id
    assert shm_segments() <= before
    if columns:  # the worker really computed its columns of every layer: its spans are in the run's trace
        events = json.loads(next(tmp_path.glob("*.json")).read_text())["traceEvents"]
        worker = {e["name"] for e in events if e.get("cat") == "linear" and e["name"].startswith("cols:")}
        assert {f"cols:layer.{i}.{n}" for i in (0, 27) for n in ("qkv", "attn_out", "gate_up", "down")} <= worker


def test_a_killed_worker_ends_the_run_with_a_reason_and_no_leak(tmp_path):
    before = shm_segments()
    with pytest.raises(ActorDead, match="sparse"):
        run_until_role_killed(_cfg(tmp_path, 0.0), "sparse", 2.0, _prompts(), 5)
    time.sleep(0.3)
    assert shm_segments() <= before
