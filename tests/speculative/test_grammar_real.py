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


_JSON_VIEW = """
import gc, sys
import llguidance
from formats.store import WeightStore
from scheduler.generation.footprint import own_anon_bytes
from speculative.grammar import _stop_ids
info = WeightStore(sys.argv[1]).tokenizer_info
stops = _stop_ids(info)
gc.collect()
before = own_anon_bytes()
view = llguidance.LLTokenizer(info.tokenizer_json, n_vocab=int(sys.argv[2]), eos_token=stops, slices=[])
del info
gc.collect()
print(own_anon_bytes() - before)
"""


def test_the_vocabulary_s_view_is_the_tokenizer_s_mask_for_mask_in_under_half_the_memory(pair):
    """A byte-level vocabulary's view for llguidance is made from its tokens' bytes (speculative/grammar.py
    `_ByteLevelTokens`), with no tokenizer behind it: on the real Qwen vocabulary every mask along a schema's answer
    (accents, CJK; the added tokens, special to both, where a string may hold any text) and every run of tokens the grammar forces is what a view
    made from the tokenizer's JSON computes, and a process holds under half of what that one holds."""
    import llguidance

    from speculative import grammar

    target, _ = pair
    store, rows = str(target.store.dir), target.args.vocab_size
    view = grammar.vocabulary(store, rows)
    info = target.store.tokenizer_info
    stops = grammar._stop_ids(info)
    ref = llguidance.LLTokenizer(info.tokenizer_json, n_vocab=rows, eos_token=stops, slices=[])
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "tags": {"type": "array", "items": {"enum": ["a<b>", "b"]}},
            "n": {"type": "integer"},
        },
        "required": ["name", "tags", "n"],
    }
    g = grammar_of(schema)
    text = '{"name": "Ada Lovelace, née Byron, 日本", "tags": ["a<b>", "b"], "n": 1815}'
    ours, theirs = llguidance.LLMatcher(view, g, log_level=0), llguidance.LLMatcher(ref, g, log_level=0)
    for t in ref.tokenize_str(text) + stops[:1]:
        assert bytes(ours.compute_bitmask()) == bytes(theirs.compute_bitmask()), t
        assert ours.compute_ff_tokens() == theirs.compute_ff_tokens(), t
        assert ours.consume_token(t) and theirs.consume_token(t), t
    assert ours.is_accepting()
    p = subprocess.run([sys.executable, "-c", _JSON_VIEW, store, str(rows)], capture_output=True, text=True, check=True)
    assert grammar.vocabulary_bytes(store, rows) < int(p.stdout) / 2
