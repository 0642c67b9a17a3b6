"""A mixture of experts through the `launch` command as a user runs it: path profile, expert bitwidths,
a run under a budget with each buffer policy giving the resident run's tokens, bad input in one sentence."""

import dataclasses
import json
import re

import pytest

from formats.weights import random_tensors
from tests.conftest import TINY
from tests.launch.conftest import launch, one_clear_line
from tests.models.tiny_files import write_gguf as write_dense_gguf
from tests.models.tiny_moe import ARCHS, write_gguf

ARGS = dataclasses.replace(
    ARCHS["olmoe"],
    dim=512,
    n_heads=4,
    n_kv_heads=4,
    head_dim=32,
    n_layers=2,
    n_experts=16,
    n_experts_used=2,
    expert_ffn_dim=2048,
)  # int4 experts of ~1.8 MB each, 56 MB in all


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    d = tmp_path_factory.mktemp("moe")
    prompts = d / "p.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"id": f"p{i}", "kind": "complete", "prompt": t}) + "\n"
            for i, t in enumerate(["def add(a, b):", "the cat sat on the mat and", "import os\nimport"])
        )
    )
    return (
        write_gguf(d / "olmoe.gguf", ARGS, random_tensors(ARGS, seed=6, scale=1.5), qtype="Q8_0"),
        prompts,
        d / "home",
    )


def rows(path):
    return json.loads(path.read_text())


def budget(resident_row: dict) -> str:
    """A budget whose expert buffer holds about half of the experts: what the run planned with every group
    resident, less half the experts' bytes (int4: 4.5 bits a weight)."""
    experts = ARGS.n_layers * ARGS.n_experts * ARGS.expert_params() * 9 // 16
    return str(resident_row["memory_plan"]["total_bytes"] - experts // 2)


def test_profile_then_every_policy_under_a_budget_gives_the_resident_tokens(moe, tmp_path):
    gguf, prompts, home = moe
    common = [
        "--target",
        str(gguf),
        "--prompts",
        str(prompts),
        "--max-new-tokens",
        "12",
        "--chat",
        "off",
        "--no-monitor",
    ]
    launch(
        "run",
        *common,
        "--mode",
        "stdpl",
        "--memory-budget",
        "4GiB",
        "--json",
        str(tmp_path / "ref.json"),
        home=home,
        check=True,
    )
    ref = {r["id"]: r["new_token_ids"] for r in rows(tmp_path / "ref.json")}  # every group resident
    p = launch(
        "models", "profile-experts", str(gguf), "--prompts", str(prompts), "--tokens", "8", home=home, check=True
    )
    assert "expert_paths.json: the paths of" in p.stdout
    limit = budget(rows(tmp_path / "ref.json")[0])
    for ev, pre in (("none", "none"), ("lru", "router"), ("edgemoe", "paths")):
        out = tmp_path / f"{ev}-{pre}.json"
        launch(
            "run",
            *common,
            "--mode",
            "stdpl",
            "--memory-budget",
            limit,
            "--expert-eviction",
            ev,
            "--expert-preload",
            pre,
            "--json",
            str(out),
            home=home,
            check=True,
        )
        for r in rows(out):
            assert r["new_token_ids"] == ref[r["id"]], (ev, pre)
            assert r.get("experts") == f"{ev}+{pre}" and r["memory_plan"]["expert_buffer_bytes"] > 0, (
                limit,
                r["memory_plan"],
            )
            assert r["memory_plan"]["expert_slots"] < ARGS.n_layers * ARGS.n_experts
            assert (
                r["stats"]["expert_requests"] > 0
                and r["stats"]["expert_misses"] > 0
                and 0 <= r["stats"]["expert_hit_rate"] <= 1
            )


def test_expert_bits_writes_a_store_that_runs(moe, tmp_path):
    gguf, prompts, home = moe
    p = launch(
        "models",
        "expert-bits",
        str(gguf),
        "--loss",
        "0.3",
        "--prompts",
        str(prompts),
        "--tokens",
        "16",
        home=home,
        check=True,
    )
    store = re.search(r"Run it with --target (\S+)", p.stdout).group(1)
    manifest = json.loads((__import__("pathlib").Path(store) / "manifest.json").read_text())
    formats = {f for _, _, f in manifest["expert_formats"]}
    assert formats <= {"int2", "int4", "int8"} and len(manifest["expert_formats"]) == ARGS.n_layers * ARGS.n_experts
    info = json.loads((__import__("pathlib").Path(store) / "expert_bits.json").read_text())
    assert info["loss"] <= 0.3 and sum(info["counts"].values()) == ARGS.n_layers * ARGS.n_experts
    out = tmp_path / "bits.json"
    launch(
        "run",
        "--target",
        store,
        "--prompts",
        str(prompts),
        "--max-new-tokens",
        "6",
        "--chat",
        "off",
        "--no-monitor",
        "--mode",
        "stdpl",
        "--memory-budget",
        "4GiB",
        "--json",
        str(out),
        home=home,
        check=True,
    )
    limit = str(rows(out)[0]["memory_plan"]["total_bytes"] - ARGS.n_layers * ARGS.n_experts * ARGS.expert_params() // 8)
    launch(
        "run",
        "--target",
        store,
        "--prompts",
        str(prompts),
        "--max-new-tokens",
        "6",
        "--chat",
        "off",
        "--no-monitor",
        "--mode",
        "stdpl",
        "--memory-budget",
        limit,
        "--json",
        str(out),
        home=home,
        check=True,
    )
    assert all(len(r["new_token_ids"]) == 6 and r["experts"].endswith("+bits") for r in rows(out))


def test_bad_expert_options_end_in_one_sentence(moe, tmp_path):
    gguf, prompts, _ = moe
    home = tmp_path / "fresh"
    line = one_clear_line(
        launch(
            "run",
            "--target",
            str(gguf),
            "--prompt",
            "x",
            "--mode",
            "stdpl",
            "--memory-budget",
            "1GiB",
            "--expert-preload",
            "paths",
            "--no-monitor",
            home=home,
        )
    )
    assert "profile-experts" in line
    dense = write_dense_gguf(tmp_path / "dense.gguf", TINY["qwen"], random_tensors(TINY["qwen"], seed=1))
    assert "no experts" in one_clear_line(launch("models", "profile-experts", str(dense), home=home))
    assert "--loss" in one_clear_line(launch("models", "expert-bits", str(gguf), "--loss", "2", home=home))
