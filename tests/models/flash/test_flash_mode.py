"""`--mode flash` end to end on a tiny int4 store with its bundles and a fitted predictor: at density 1.0 it is
the dense target bit for bit; below, it runs on the predicted neurons, reads bundles through the cache, stays
within its budget's plan, and every output says it is approximate (never lossless)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from common.errors import CadenceError
from engine.config import RunConfig
from engine.memory import kv_rows
from engine.prompts import Prompt
from engine.runner import Runner
from formats import loading
from formats.convert import convert
from flash import bundles
from flash.footprint import predictor_bytes, predictors, top_k
from flash.predictor import Predictor
from flash.train import FitConfig, fit
from flash.weights import FlashWeights
from formats.source import GGUFSource
from formats.store import WeightStore
from models.transformer import Transformer
from formats.weights import random_tensors
from serve.app import ServeConfig
from tests.conftest import TINY
from tests.models.tiny_files import write_gguf

ARGS = dataclasses.replace(TINY["qwen"], ffn_dim=256)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("flash")
    src = GGUFSource(write_gguf(root / "m.gguf", ARGS, random_tensors(ARGS, seed=3)))
    st = WeightStore(convert(src, root / "store", "int4"))
    bundles.write(st, 3, source=src)
    lm = loading.load_store(st)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, ARGS.vocab_size, (10,), generator=g).tolist() for _ in range(6)]
    for cfg in (FitConfig(rank=16), FitConfig(rank=64), FitConfig(kind="int2")):
        fit(lm.model, prompts[:4], prompts[4:], dataclasses.replace(cfg, density=0.3, tokens=10)).save(st)
    return st


def _greedy(model: Transformer, ids: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    cache = model.new_cache(len(ids) + n)
    logits = model.forward(torch.tensor(ids), torch.arange(len(ids)), cache, logits_rows=slice(-1, None))
    cache.commit()
    out, seen = [], [logits[-1]]
    for _ in range(n - 1):
        out.append(int(logits[-1].argmax()))
        logits = model.forward(torch.tensor(out[-1:]), torch.tensor([cache.length]), cache)
        cache.commit()
        seen.append(logits[-1])
    return out, seen


def test_density_one_is_the_dense_target_bit_for_bit(store):
    dense = loading.load_store(store).model
    flash = FlashWeights(store, Predictor.load(store), 1.0)
    ids = list(range(5, 17))
    want, want_logits = _greedy(dense, ids, 12)
    got, got_logits = _greedy(Transformer(store.args, flash), ids, 12)
    assert got == want
    assert all(torch.equal(a, b) for a, b in zip(got_logits, want_logits))
    assert flash.stats.dense_passes == 12 * ARGS.n_layers and flash.stats.sparse_passes == 0
    flash.reset_stats()  # a new generation's counts: the dense reads apart from the bundle reads
    _greedy(Transformer(store.args, flash), ids, 2)
    assert flash.stats.dense.bytes > 0 and flash.stats.bundles.bytes == 0
    flash.close()


@pytest.mark.parametrize("predictor", ["int2", "r16"])
def test_sparse_passes_compute_the_predicted_neurons_from_the_cache(store, predictor):
    """A step's FFN over the cached predicted neurons equals the reference FFN over exactly those records."""
    from models import flash_records as records

    w = FlashWeights(store, Predictor.load(store, predictor), 0.5)
    w.allocate(ARGS.ffn_dim // 2 + 16)
    ffn = w.layer(0).flash
    h = torch.randn(1, ARGS.dim)
    x = torch.zeros(1, ARGS.dim)
    ffn(h, x)
    ids = w.predictor.top(0, h, w.k).reshape(-1).numpy()
    recs = w.reader.read(0, ids)
    assert torch.allclose(x, records.ffn_reference(h, recs, ARGS.dim), rtol=1e-4, atol=1e-5)
    assert w.stats.loaded == w.k and w.stats.bundles.bytes > 0  # a cold cache read them all
    before = w.stats.loaded
    ffn(h, torch.zeros(1, ARGS.dim))  # the same token again: every neuron is in the cache now
    assert w.stats.loaded == before
    w.close()


def _run(store, **options) -> dict:
    cfg = RunConfig.from_options(target=str(store.dir), mode="flash", max_new_tokens=8, **options)
    p = Prompt("p", "complete", "def f(x): return")
    with Runner(cfg, [p]) as r:
        return r.run(p).row


def test_rows_say_approximate_and_density_one_gives_the_targets_tokens(store):
    target = RunConfig.from_options(target=str(store.dir), mode="target", max_new_tokens=8, runtime="inproc")
    p = Prompt("p", "complete", "def f(x): return")
    with Runner(target, [p]) as r:
        want = r.run(p).row["new_token_ids"]
    one = _run(store, ffn_density=1.0)
    assert one["approximate"] is True and one["mode"] == "flash"  # even at 1.0: the mode never claims lossless
    assert one["new_token_ids"] == want
    half = _run(store, ffn_density=0.5, memory_budget="2GiB")
    assert half["approximate"] is True and half["flash"]["sparse_passes"] > 0
    assert half["flash"]["predictor"] == predictors(store)[0]
    assert ServeConfig("m", approximate="flash-ffn-density-0.5").fingerprint.startswith("cadence-approximate")
    assert ServeConfig("m").fingerprint == "cadence-lossless"


def test_the_plan_takes_the_best_predictor_that_leaves_a_tokens_neurons(store):
    """engine/flash.py `plan`: the predictors best first (by recall); the first whose bytes leave caches of at
    least a token's neurons under the budget, else the last one's sentence."""
    from engine.decide import decide
    from engine.flash import MARGIN, plan
    from engine.machine import ThisMachine
    from models import flash_records as records

    names = predictors(store)
    size = {n: predictor_bytes(store, n) for n in names}
    assert names[0] == "r64" and size["r64"] > max(size["r16"], size["int2"])  # the best is the largest here
    cfg = RunConfig.from_options(target=str(store.dir), mode="flash", ffn_density=0.5, max_new_tokens=8)
    run = decide(cfg, ThisMachine(), (1,))
    k, per_neuron = top_k(0.5, ARGS.ffn_dim), ARGS.n_layers * records.record_bytes(ARGS.dim)
    process, kv = 300 << 20, ARGS.kv_bytes(kv_rows(run))
    at = lambda budget: dataclasses.replace(run, budget=budget)  # noqa: E731
    for room in (size["r64"], min(size.values())):  # room for the best predictor, then only for the smallest
        budget = process + kv + MARGIN + room + k * per_neuron
        p = plan(at(budget), process)
        want = next(n for n in names if size[n] <= room)
        assert p.predictor == want and p.predictor_bytes == size[want] and p.capacity >= k, (room, p)
    with pytest.raises(CadenceError, match=f"beside the {min(names, key=size.get)} predictor"):
        plan(at(budget - 1 - k * per_neuron // 2), process)


def test_a_budget_too_small_and_a_missing_predictor_end_in_one_sentence(store, tmp_path):
    with pytest.raises(CadenceError, match="--memory-budget .* leaves room for"):
        _run(store, ffn_density=0.5, memory_budget="64MiB")
    with pytest.raises(CadenceError, match="must be above 0 and at most 1"):
        RunConfig.from_options(mode="flash", ffn_density=1.5)
    bare = WeightStore(
        convert(
            GGUFSource(write_gguf(tmp_path / "b.gguf", ARGS, random_tensors(ARGS, seed=4))), tmp_path / "bare", "int4"
        )
    )
    with pytest.raises(CadenceError, match="train-predictor"):
        _run(bare)
    for budget in (None, "auto"):  # --draft flash over the actors: said before any actor starts, with or without a plan
        cfg = RunConfig.from_options(target=str(bare.dir), mode="tree", draft="flash", memory_budget=budget)
        with pytest.raises(CadenceError, match="has no (FFN bundles|activation predictor)"):
            Runner(cfg, [Prompt("p", "complete", "def f(x): return")])


@pytest.mark.parametrize(
    "mode,runtime,budget",
    [("tree", "inproc", None), ("chain", "inproc", None), ("tree", "actors", None), ("tree", "actors", "auto")],
)
def test_draft_flash_is_lossless(store, mode, runtime, budget):
    """The target's own sparse FFN drafts (flash/sparse_target.py), the dense target verifies: the target's
    tokens, in one process, over the actors, and over the actors under a budget's plan that holds the draft's caches."""
    p = Prompt("p", "complete", "def f(x): return x + 1")
    rows = {}
    for m, draft, rt in (("target", "none", "inproc"), (mode, "flash", runtime)):
        cfg = RunConfig.from_options(
            target=str(store.dir),
            mode=m,
            draft=draft,
            max_new_tokens=24,
            runtime=rt,
            ffn_density=0.3,
            memory_budget=budget if m != "target" else None,
        )
        with Runner(cfg, [p]) as r:
            rows[m] = r.run(p).row
            plan = r.plan
    got = rows[mode]
    assert got["new_token_ids"] == rows["target"]["new_token_ids"]
    assert got["draft"] == "flash" and "approximate" not in got
    assert got["stats"]["verifications"] > 0 and got["stats"]["drafted"] > 0
    reads = got["stats"]["draft_flash"]  # the draft's own reads and passes, in either runtime
    assert reads["sparse_passes"] > 0 and reads["dense_passes"] > 0 and reads["neurons"] >= reads["loaded"]
    if budget:
        assert plan.memory.has_draft  # the draft's caches are in the plan (a tiny target fits whole: the real one
        # streams beside them in tests/scheduler/test_lean_runtime.py)
        assert plan.draft.flash[2] >= round(0.3 * ARGS.ffn_dim) and plan.draft.flash[1:] == plan.memory.draft_choice


def test_launch_plan_says_what_flash_mode_plans(store, tmp_path):
    """`launch plan --mode flash`: the run decided, and where its neuron caches are sized (no traceback)."""
    import os
    import subprocess
    import sys

    from common import paths

    env = dict(os.environ, CADENCE_HOME=str(tmp_path), CADENCE_KERNELS_DIR=str(paths.kernels_dir()))

    def plan(*options):
        cmd = [sys.executable, "-m", "launch.cli", "plan", "--target", str(store.dir), "--memory-budget", "1GiB"]
        p = subprocess.run([*cmd, *options], capture_output=True, text=True, env=env, timeout=300)
        assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
        return p.stdout

    out = plan("--mode", "flash")
    assert "--mode flash sizes its neuron caches" in out and "1.00 GiB" in out
    out = plan("--draft", "flash")  # the target's own FFN as the draft: its predictor and caches are in the plan
    assert "flash draft: the " in out and "tree --draft flash" in out, out
