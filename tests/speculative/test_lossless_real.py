"""Lossless on the real pair: Qwen2.5-Coder 0.5B drafting for 1.5B, six dev prompts of every kind, 64 tokens, greedy.

`chain` runs in process; `tree` runs as a user runs it: `launch run` with the draft and verifier as
actor processes. Both must give the target's own token ids, token for token.
"""

import json
import os
import subprocess
import sys

import pytest

from common import paths
from engine.prompts import Prompt, encode_prompt
from common.settings import SamplingConfig
from common.settings import TreeConfig
from speculative.generate import generate_speculative, generate_target
from tests.conftest import door_kv_dtype, kv_dtype_of, real_model, some_dev_prompts

pytestmark = [pytest.mark.real, pytest.mark.slow]
N = 64  # the lossless check on every dev prompt; 64 tokens hold several verifications each
FMT = "int4"


@pytest.fixture(scope="module")
def pair():
    """The pair with the caches every door writes unless told (f16): the references are the target alone at the
    dtype `launch run` uses."""
    with kv_dtype_of((real_model("qwen2.5-coder-1.5b", FMT), real_model("qwen2.5-coder-0.5b", FMT)), door_kv_dtype()):
        yield real_model("qwen2.5-coder-1.5b", FMT), real_model("qwen2.5-coder-0.5b", FMT)


@pytest.fixture(scope="module")
def prompts(pair):
    target, _ = pair
    return {
        p["id"]: encode_prompt(target.tokenizer, Prompt(p["id"], p["kind"], p["prompt"]), "auto")[0]
        for p in some_dev_prompts()
    }


@pytest.fixture(scope="module")
def reference(pair, prompts):
    target, _ = pair
    return {pid: generate_target(target, ids, N, SamplingConfig()).new_ids for pid, ids in prompts.items()}


def test_chain_equals_target(pair, prompts, reference):
    target, draft = pair
    cfg = TreeConfig(mode="chain", chain_k=4)
    for pid, ids in prompts.items():
        got = generate_speculative(target, draft, ids, N, SamplingConfig(), cfg)
        assert got.new_ids == reference[pid], pid
        assert got.stats["verifications"] > 0


@pytest.mark.parametrize("growth,width", [("pacer", 8), ("best", 32)])
def test_the_lean_int2_draft_equals_target(growth, width, prompts, reference):
    """The 0.5B in the model format int2 (its FFN in 2 bits: the draft a 0.5 GiB budget holds) drafts a tree,
    grown by LLMCad's pacer or best first 32 wide (as at 0.5 GiB): it agrees with the target less, and the
    output is still the target's. Each growth takes half the prompts (every other one: three kinds each)."""
    target, draft = real_model("qwen2.5-coder-1.5b", FMT), real_model("qwen2.5-coder-0.5b", "int2")
    assert draft.store.tensors["blk.0.ffn_down"]["format"] == "int2"
    assert draft.store.tensors["blk.0.attn_qkv"]["format"] == "int4"
    accepted = 0
    half = list(prompts.items())[growth == "best" :: 2]
    for pid, ids in half:
        got = generate_speculative(target, draft, ids, N, SamplingConfig(), TreeConfig(width=width, growth=growth))
        assert got.new_ids == reference[pid], pid
        accepted += got.stats["accepted"]
    assert accepted > 0


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingConfig(repetition_penalty=1.3, frequency_penalty=0.2, repeat_last_n=-1),
        SamplingConfig(temperature=1.0, top_k=40, top_p=0.9, min_p=0.05, presence_penalty=0.4, seed=6),
    ],
    ids=["greedy+penalties", "sampled+every-control"],
)
def test_tree_under_sampling_controls_equals_target(pair, prompts, sampling):
    """Greedy with penalties, and sampling with a seed: the tree (and the chain) write the target's own tokens under
    the same controls, token for token, and the draft's trees are accepted (its candidates ranked by the scores the
    target's choice is the argmax of)."""
    target, draft = pair
    accepted = 0
    for pid in ("fib", "rewrite_hints"):
        ids = prompts[pid]
        ref = generate_target(target, ids, 32, sampling).new_ids
        for cfg in (TreeConfig(width=16, growth="best"), TreeConfig(mode="chain", chain_k=4)):
            got = generate_speculative(target, draft, ids, 32, sampling, cfg)
            assert got.new_ids == ref, (pid, cfg.mode)
            accepted += got.stats["accepted"]
    assert accepted > 16
    if sampling.penalized and sampling.greedy:
        assert ref != generate_target(target, ids, 32, SamplingConfig()).new_ids


def _prompt_file(folder) -> str:
    path = folder / "some.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in some_dev_prompts()))
    return str(path)


def test_tree_over_actors_equals_target(reference, tmp_path):
    out = tmp_path / "rows.json"
    env = dict(os.environ, CADENCE_KERNELS_DIR=str(paths.kernels_dir()))
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "launch.cli",
            "run",
            "--mode",
            "tree",
            "--dtype",
            FMT,
            "--prompts",
            str(_prompt_file(tmp_path)),
            "--max-new-tokens",
            str(N),
            "--json",
            str(out),
            "--trace-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert {r["id"] for r in rows} == set(reference)
    for r in rows:
        assert r["mode"] == "tree" and r["runtime"] == "actors"
        assert r["new_token_ids"] == reference[r["id"]], r["id"]
    assert sum(r["stats"]["verifications"] for r in rows) > 0
    assert list(tmp_path.glob("*.json")) != [out]  # a Chrome trace was written beside the rows


@pytest.mark.parametrize(
    "mode,ahead,growth",
    [("chain", 0, "auto"), ("tree", 0, "pacer"), ("chain", 3, "auto"), ("tree", 3, "pacer"), ("tree", 3, "best")],
)
def test_a_draft_equal_to_the_target_is_always_accepted(mode, ahead, growth, prompts):
    """With `ahead`, the draft drafts on from its best leaf before each verdict; that leaf and the
    target's next token are always right here, so every next tree starts from the reused chain:
    the draft's KV entries for it must be exactly those a fresh feed would write, or a token
    would be rejected."""
    lm = real_model("qwen2.5-coder-0.5b", FMT)
    cfg = TreeConfig(
        mode=mode, width=6, chain_k=4, trie=False, adaptive=False, ahead=ahead, prompt_window=0, growth=growth
    )  # the draft sees what the target sees: the whole prompt
    for pid in ("fib", "rewrite_hints"):
        ids = prompts[pid]
        ref = generate_target(lm, ids, 48, SamplingConfig()).new_ids
        got = generate_speculative(lm, lm, ids, 48, SamplingConfig(), cfg)
        assert got.new_ids == ref, pid
        hist = {int(k): v for k, v in got.stats["accepted_hist"].items()}
        if mode == "chain":  # every drafted token accepted: each verification took the full chain
            assert got.stats["accepted"] == got.stats["drafted"], got.stats
        elif not ahead:  # every verification accepted its most confident branch whole: alpha halved each time
            alphas = [cfg.alpha] + got.stats["alpha"]
            assert all(b == pytest.approx(max(a * 0.5, 1e-6), abs=1e-6) for a, b in zip(alphas, alphas[1:])), alphas
        assert min(hist) > 0
        if ahead:  # every tree after the first grew from the chain drafted during the last verification
            assert got.stats["ahead_steps"] == ahead * got.stats["verifications"], got.stats
            assert got.stats["ahead_reused"] >= (ahead - 2) * (got.stats["verifications"] - 1) > 0, got.stats
        else:
            assert got.stats["ahead_steps"] == got.stats["ahead_reused"] == 0


@pytest.mark.parametrize("budget", [None, "768MiB"])
def test_parallel_generations_over_actors_equal_target(reference, tmp_path, budget):
    """`launch run --parallel 4`: six prompts, four at a time (the others joining as slots free), every cycle's
    trees verified in one forward; resident, and under a budget where each streamed layer is read once for all of
    them. Each prompt's tokens are the target's alone. Resident, the trees are fixed (`--fixed-width`): there a
    batch of four tries drafting only once its drafts' catch-up is a small share of its time (`CatchUp`), which a
    run this short never reaches on a 2-core CPU. Under the budget the draft's own caches are q8 (`--draft-kv-dtype`,
    what a plan too small for the draft in f16 picks): it only proposes, so the text is still the target's with f16
    caches."""
    chosen = some_dev_prompts()
    prompts = _prompt_file(tmp_path)
    out = tmp_path / "rows.json"
    env = dict(os.environ, CADENCE_KERNELS_DIR=str(paths.kernels_dir()))
    cmd = [sys.executable, "-m", "launch.cli", "run", "--dtype", FMT, "--prompts", prompts, "--parallel", "4"]
    cmd += ["--max-new-tokens", str(N), "--json", str(out), "--no-trace"]
    cmd += ["--memory-budget", budget, "--draft-kv-dtype", "q8"] if budget else ["--fixed-width"]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    assert p.returncode == 0, p.stderr[-2000:]
    assert ("draft_kv_dtype=q8" in p.stdout + p.stderr) == bool(budget)
    rows = json.loads(out.read_text())
    assert sorted(r["id"] for r in rows) == sorted(p["id"] for p in chosen)
    for r in rows:
        assert r["new_token_ids"] == reference[r["id"]], r["id"]
    assert sum(r["stats"]["accepted"] for r in rows) > 0
    if budget:
        assert all(r["memory_plan"]["streamed_groups"] > 0 for r in rows)


def test_q8_kv_caches_over_actors_under_a_budget_equal_the_target_at_their_dtype(pair, prompts, tmp_path):
    """`--kv-dtype q8` (the default f16 is every other test's here) at 768 MiB with two slots: the target streamed,
    the draft's caches, the slots' pool and the verifier's all q8_0 rows; each prompt's tokens are the target's alone
    with such caches, token for token."""
    kv = "q8"
    target, _ = pair
    chosen = [p for p in some_dev_prompts() if p["id"] in ("fib", "sql", "explain")]
    with kv_dtype_of((target,), kv):
        want = {p["id"]: generate_target(target, prompts[p["id"]], 48, SamplingConfig()).new_ids for p in chosen}
    path, out = tmp_path / "three.jsonl", tmp_path / "rows.json"
    path.write_text("".join(json.dumps(p) + "\n" for p in chosen))
    env = dict(os.environ, CADENCE_KERNELS_DIR=str(paths.kernels_dir()))
    cmd = [sys.executable, "-m", "launch.cli", "run", "--dtype", FMT, "--prompts", str(path), "--parallel", "2"]
    cmd += ["--max-new-tokens", "48", "--json", str(out), "--no-trace", "--memory-budget", "768MiB"]
    p = subprocess.run(cmd + ["--kv-dtype", kv], capture_output=True, text=True, env=env, timeout=1800)
    assert p.returncode == 0, p.stderr[-2000:]
    assert f"kv_dtype={kv}" in p.stdout + p.stderr
    rows = json.loads(out.read_text())
    assert {r["id"]: r["new_token_ids"] for r in rows} == want
    assert all(r["memory_plan"]["streamed_groups"] > 0 for r in rows) and sum(r["stats"]["accepted"] for r in rows) > 0


def _tree_rows(runtime: str, ahead: str, tmp_path) -> list[dict]:
    from engine.config import RunConfig
    from engine.prompts import load_prompts
    from engine.runner import Runner

    cfg = RunConfig.from_options(
        runtime=runtime, mode="tree", fixed_width=True, draft_ahead=ahead, max_new_tokens=N, no_trace=True
    )
    with Runner(cfg) as runner:
        return [
            {"id": p.id, "new_token_ids": c.completion.token_ids, "stats": c.completion.stats}
            for p, c in runner.stream_many(load_prompts(_prompt_file(tmp_path)))
            if c.completion is not None
        ]


def test_one_message_a_cycle_to_the_draft_actor_keeps_what_the_draft_reckons(reference, tmp_path):
    """The draft actor hears each verdict with the next cycle's message (actors/calls.py `DraftCycle`), so the
    scheduler reckons alpha after a verdict as the draft does: over the actors, the tokens, the trees' acceptance
    and every alpha are the in-process run's, where the draft itself reckons them (fixed widths: no governor's
    timing). Drafting ahead after the cycle's reply, until the verdict, changes no token, and its counts arrive."""
    inproc = {r["id"]: r for r in _tree_rows("inproc", "0", tmp_path)}
    actors = {r["id"]: r for r in _tree_rows("actors", "0", tmp_path)}
    for pid, r in actors.items():
        assert r["new_token_ids"] == inproc[pid]["new_token_ids"] == reference[pid], pid
        for key in ("alpha", "accepted_hist", "verifications", "drafted"):
            assert r["stats"][key] == inproc[pid]["stats"][key], (pid, key)
    assert any(len(set(r["stats"]["alpha"])) > 2 for r in actors.values())  # alphas that moved, verdict by verdict
    ahead = _tree_rows("actors", "2", tmp_path)
    for r in ahead:
        assert r["new_token_ids"] == reference[r["id"]], r["id"]
    assert sum(r["stats"]["ahead_steps"] for r in ahead) > 0
