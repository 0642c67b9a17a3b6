"""Against an outside reference: HF transformers (loading the same GGUF) on the real small models, fp32."""

import pytest
import torch

from engine.prompts import Prompt, encode_prompt
from formats.convert import resolve
from common.settings import SamplingConfig
from speculative.generate import generate_target
from tests.conftest import dev_prompts, real_model, some_dev_prompts
from tests.models.hf_cache import hf_greedy, hf_model

pytestmark = [pytest.mark.real, pytest.mark.slow]
GREEDY = 40  # tokens each prompt generates, far enough for a wrong rope or cache row to show


def _hf(name):
    """HF's own GGUF loader, dequantizing to fp32 (its build kept: tests/models/hf_cache.py)."""
    return hf_model(resolve(name)[1])


@pytest.fixture(scope="module", params=["smollm2-135m", "qwen2.5-coder-0.5b"])
def pair(request):
    """(ours, transformers', the GGUF both load)."""
    return real_model(request.param, "fp32"), _hf(request.param), resolve(request.param)[1]


def _ids(lm, p):
    return encode_prompt(lm.tokenizer, Prompt(p["id"], p["kind"], p["prompt"]), "auto")[0]


def test_logits_match_within_1e3(pair):
    lm, hf, gguf = pair
    for p in dev_prompts()[:4]:
        ids = _ids(lm, p)
        cache = lm.model.new_cache(len(ids))
        ours = lm.model.forward(torch.tensor(ids), torch.arange(len(ids)), cache)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
        assert (ours - ref).abs().max() <= 1e-3, p["id"]


def test_greedy_40_tokens_identical_on_six_dev_prompts(pair):
    """HF generates every prompt in one left-padded batch (its positions come from the attention
    mask; its answers kept: tests/models/hf_cache.py), ours one prompt at a time: the same tokens either way."""
    lm, hf, gguf = pair
    prompts = some_dev_prompts()
    seqs = [_ids(lm, p) for p in prompts]
    refs = hf_greedy(gguf, hf, seqs, GREEDY)
    for p, ids, ref in zip(prompts, seqs, refs):
        ours = generate_target(lm, ids, GREEDY, SamplingConfig(), stop_at_eos=False).new_ids
        assert ours == ref, p["id"]
