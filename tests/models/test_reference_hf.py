"""Against an outside reference: HF transformers (loading the same GGUF) on the real small models, fp32."""

import json
import os

import pytest
import torch

from common import paths

from engine.prompts import Prompt, encode_prompt
from formats.convert import resolve
from common.settings import SamplingConfig
from speculative.generate import generate_target
from tests.conftest import dev_prompts, real_model, some_dev_prompts

pytestmark = [pytest.mark.real, pytest.mark.slow]
GREEDY = 40  # tokens each prompt generates, far enough for a wrong rope or cache row to show


def _hf(name):
    """HF's own GGUF loader, dequantizing to fp32. What it built is kept under
    $CADENCE_HOME/hf-reference (config + safetensors, keyed by the GGUF's sha256), since that
    conversion costs about a minute a model; a later run rebuilds the model from there."""
    from safetensors.torch import load_model, save_model
    from transformers import AutoConfig, AutoModelForCausalLM

    _, path, sha = resolve(name)
    cache = paths.home() / "hf-reference" / f"{name}-{sha[:12]}-fp32"
    if (cache / "model.safetensors").exists():
        config = AutoConfig.from_pretrained(cache)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        load_model(model, cache / "model.safetensors")
        return model.eval()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    tmp = cache.with_name(cache.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(config))
    save_model(model, tmp / "model.safetensors")
    os.replace(tmp, cache)
    return model


@pytest.fixture(scope="module", params=["smollm2-135m", "qwen2.5-coder-0.5b"])
def pair(request):
    return real_model(request.param, "fp32"), _hf(request.param)


def _ids(lm, p):
    return encode_prompt(lm.tokenizer, Prompt(p["id"], p["kind"], p["prompt"]), "auto")[0]


def test_logits_match_within_1e3(pair):
    lm, hf = pair
    for p in dev_prompts()[:4]:
        ids = _ids(lm, p)
        cache = lm.model.new_cache(len(ids))
        ours = lm.model.forward(torch.tensor(ids), torch.arange(len(ids)), cache)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
        assert (ours - ref).abs().max() <= 1e-3, p["id"]


def test_greedy_40_tokens_identical_on_six_dev_prompts(pair):
    """HF generates every prompt in one left-padded batch (its positions come from the attention
    mask), ours one prompt at a time: the same tokens either way."""
    lm, hf = pair
    prompts = some_dev_prompts()
    seqs = [_ids(lm, p) for p in prompts]
    n = max(map(len, seqs))
    inp = torch.tensor([[0] * (n - len(x)) + x for x in seqs])
    mask = torch.tensor([[0] * (n - len(x)) + [1] * len(x) for x in seqs])
    with torch.no_grad():
        out = hf.generate(
            inp,
            attention_mask=mask,
            max_new_tokens=GREEDY,
            min_new_tokens=GREEDY,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    for p, ids, ref in zip(prompts, seqs, out[:, n:].tolist()):
        ours = generate_target(lm, ids, GREEDY, SamplingConfig(), stop_at_eos=False).new_ids
        assert ours == ref, p["id"]
