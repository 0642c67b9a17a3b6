"""JSON schemas on the real pair (Qwen2.5-Coder 0.5B drafting for 1.5B, greedy): every answer parses and validates
with `jsonschema`, and the tree and the chain write the target's own tokens under the same grammar, in process and
as a user runs it (`launch run --grammar FILE`, actor processes) under a memory budget that streams layers."""

import json
import os
import subprocess
import sys

import pytest

from common import paths
from common.settings import SamplingConfig, TreeConfig
from engine.prompts import Prompt, encode_prompt
from speculative.grammar import grammar_of
from speculative.generate import generate_speculative, generate_target
from tests.conftest import real_model
from bench.grammar import SCHEMAS

jsonschema = pytest.importorskip("jsonschema")
pytestmark = [pytest.mark.real, pytest.mark.slow]
N = 160  # every schema's greedy answer closes well within it
FMT = "int4"


@pytest.fixture(scope="module")
def pair():
    return real_model("qwen2.5-coder-1.5b", FMT), real_model("qwen2.5-coder-0.5b", FMT)


def _ids(target, ask: str) -> list[int]:
    return encode_prompt(target.tokenizer, Prompt("q", "chat", ask, chat=True), "auto")[0]


def _answer(target, got) -> dict:
    assert got.new_ids[-1] in target.tokenizer.stop_ids, "the answer did not close"
    return json.loads(target.tokenizer.decode(got.new_ids, skip_special=True))


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_answer_validates_and_the_tree_writes_the_targets_own(pair, name):
    target, draft = pair
    ask, schema = SCHEMAS[name]
    sampling = SamplingConfig(grammar=grammar_of(schema))
    ids = _ids(target, ask)
    alone = generate_target(target, ids, N, sampling)
    jsonschema.validate(_answer(target, alone), schema)
    for cfg in (TreeConfig(width=16, growth="best"), TreeConfig(mode="chain", chain_k=4)):
        got = generate_speculative(target, draft, ids, N, sampling, cfg)
        assert got.new_ids == alone.new_ids, (name, cfg.mode)
        assert got.stats["accepted"] > 0


def test_a_schema_over_actors_under_a_budget_is_the_target_alone(pair, tmp_path):
    """`launch run --grammar schema.json --memory-budget 1GiB`: the verifier streams layers in its own process, the
    draft proposes under the grammar in its own; each answer is the in-process target's alone, and validates."""
    target, _ = pair
    ask, schema = SCHEMAS["array"]
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "array", "kind": "explain", "prompt": ask, "chat": True}) + "\n")
    out = tmp_path / "rows.json"
    env = dict(os.environ, CADENCE_KERNELS_DIR=str(paths.kernels_dir()))
    cmd = [sys.executable, "-m", "launch.cli", "run", "--dtype", FMT, "--prompts", str(prompts), "--no-trace"]
    cmd += ["--grammar", str(tmp_path / "schema.json"), "--memory-budget", "1GiB", "--max-new-tokens", str(N)]
    cmd += ["--json", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    assert p.returncode == 0, p.stderr[-2000:]
    (row,) = json.loads(out.read_text())
    alone = generate_target(target, _ids(target, ask), N, SamplingConfig(grammar=grammar_of(schema)))
    assert row["new_token_ids"] == alone.new_ids
    assert row["memory_plan"]["streamed_groups"] > 0 and row["stats"]["verifications"] > 0
    jsonschema.validate(_answer(target, alone), schema)
