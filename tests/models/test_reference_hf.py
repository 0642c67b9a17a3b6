"""Against an outside reference: HF transformers (loading the same GGUF) on the real small models, fp32."""
import pytest
import torch

from launch.prompts import Prompt, prompt_ids
from models import engine
from models.convert import resolve
from models.sampling import SamplingConfig
from tests.conftest import dev_prompts, real_model

pytestmark = [pytest.mark.real, pytest.mark.slow]


def _hf(name):
    from transformers import AutoModelForCausalLM

    _, path, _ = resolve(name)
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=["smollm2-135m", "qwen2.5-coder-0.5b"])
def pair(request):
    return real_model(request.param, "fp32"), _hf(request.param)


def _ids(lm, p):
    return prompt_ids(lm.tokenizer, Prompt(p["id"], p["kind"], p["prompt"]), "auto")[0]


def test_logits_match_within_1e3(pair):
    lm, hf = pair
    for p in dev_prompts()[:4]:
        ids = _ids(lm, p)
        cache = lm.model.new_cache(len(ids))
        ours = lm.model.forward(torch.tensor(ids), torch.arange(len(ids)), cache)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
        assert (ours - ref).abs().max() <= 1e-3, p["id"]


def test_greedy_64_tokens_identical_on_every_dev_prompt(pair):
    lm, hf = pair
    for p in dev_prompts():
        ids = _ids(lm, p)
        ours = engine.generate_target(lm, ids, 64, SamplingConfig(), stop_at_eos=False).new_ids
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=64, min_new_tokens=64, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert ours == out[0, len(ids):].tolist(), p["id"]
