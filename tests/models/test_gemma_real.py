"""The real Gemma 3 270M (a SentencePiece vocabulary of 262k, 15 sliding layers of window 512 among 18, q/k norms,
GeGLU): against an outside reference, HF transformers loading the same GGUF in fp32, on prompts nobody here wrote;
and `target`, `tree` (the trie: no other model shares its vocabulary) and `stdpl` give the same tokens in int4,
resident and with most of its layers streamed from disk under a budget, over the actors."""

import pytest
import torch

from common.settings import SamplingConfig
from engine.prompts import Prompt, encode_prompt
from formats import loading
from speculative.generate import generate_target

pytestmark = [pytest.mark.real, pytest.mark.gemma, pytest.mark.slow]
N = 32
PROMPTS = [  # raw text: a base model continues it (the held-out set's code prompts, and prose)
    Prompt("merge", "complete", 'def merge_intervals(intervals):\n    """Merge overlapping intervals."""\n'),
    Prompt("prose", "open", "The history of the printing press begins in"),
    Prompt("list", "complete", "Three reasons to learn a second language:\n1."),
]


@pytest.fixture(scope="module")
def gemma(gemma_270m):
    return loading.load(str(gemma_270m), "fp32")


@pytest.fixture(scope="module")
def hf(gemma_270m):
    from tests.models.hf_cache import hf_model

    return hf_model(gemma_270m)  # transformers' own GGUF loader (its build kept)


def _ids(lm, p: Prompt) -> list[int]:
    return encode_prompt(lm.tokenizer, p, "off")[0]


def test_fp32_greedy_tokens_are_transformers_own_on_the_real_model(gemma, hf):
    """Identical greedy tokens, or parting only at one of HF's own near ties (top two within 1e-4 of each other).
    HF decodes our tokens one at a time over its own KV cache (its sliding layers' too)."""
    for p in PROMPTS:
        ids = _ids(gemma, p)
        assert ids[0] == 2  # <bos>, which Gemma needs
        ours = generate_target(gemma, ids, N, SamplingConfig(), stop_at_eos=False).new_ids
        with torch.no_grad():
            out = hf(torch.tensor([ids]), use_cache=True)
            for k, tok in enumerate(ours):
                top = out.logits[0, -1].topk(2)
                if tok != int(top.indices[0]):
                    assert float(top.values[0] - top.values[1]) < 1e-4, (p.id, k)
                    break
                out = hf(torch.tensor([[tok]]), cache=out.cache, use_cache=True)


def test_target_tree_and_streamed_runs_agree_on_the_real_model(gemma_270m, tmp_path):
    """`launch run` itself, over the actors: the trie's tree and stdpl at a budget that streams most layers give
    the target's tokens, as the target alone does resident."""
    import json
    import subprocess
    import sys

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": p.id, "kind": p.kind, "prompt": p.text}) + "\n" for p in PROMPTS))
    rows = {}
    for mode, budget in (("target", None), ("stdpl", "330MiB"), ("tree", "330MiB")):  # resident trees: elsewhere
        out = tmp_path / f"{mode}-{budget}.jsonl"
        cmd = [sys.executable, "-m", "launch.cli", "run", "--target", str(gemma_270m), "--mode", mode]
        cmd += ["--prompts", str(prompts), "--max-new-tokens", str(N), "--chat", "off", "--json", str(out)]
        cmd += ["--no-trace"] + (["--memory-budget", budget] if budget else [])
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        got = json.loads(out.read_text())
        rows[mode, budget] = {r["id"]: r["new_token_ids"] for r in got}
        if budget:
            plan = got[0]["memory_plan"]
            assert plan["streamed_groups"] > plan["resident_groups"], plan  # most layers from disk
            assert got[0]["stats"]["bytes_read"] > 0
    reference = rows["target", None]
    assert all(len(ids) == N for ids in reference.values())
    for key, got in rows.items():
        assert got == reference, key
