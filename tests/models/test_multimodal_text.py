"""A multimodal checkpoint (Mistral 3's `Mistral3ForConditionalGeneration` wrapping Ministral 3 or Mistral 4; Gemma 4 and
Qwen 3.5 ship the same way): its config nests the text model's in `text_config`, its weights sit under
`model.language_model.` (llava's older dumps: `language_model.model.`) beside a vision tower. cadence reads the text
model, the same as the text-only directory, skips the vision tensors, and says that images are not run."""

import json
import shutil

import numpy as np
import pytest
import torch

from formats.convert import convert
from formats.source import canonical_names
from formats.source_hf import HFSource
from tests.models.families import tiny_hf


def _wrap(plain, out, prefix: str, head: str):
    from safetensors.torch import load_file, save_file

    shutil.copytree(plain, out)
    text = json.loads((plain / "config.json").read_text())
    cfg = {
        "model_type": "mistral3",
        "architectures": ["Mistral3ForConditionalGeneration"],
        "text_config": text,
        "vision_config": {"model_type": "pixtral", "hidden_size": 32},
        "image_token_index": 10,
        "multimodal_projector_bias": False,
        "projector_hidden_act": "gelu",
        "spatial_merge_size": 2,
        "vision_feature_layer": -1,
    }
    (out / "config.json").write_text(json.dumps(cfg))
    tensors = {}
    for k, v in load_file(plain / "model.safetensors").items():
        tensors[head if k == "lm_head.weight" else prefix + k.removeprefix("model.")] = v
    tensors["model.vision_tower.transformer.layers.0.attention.q_proj.weight"] = torch.ones(32, 32)
    tensors["model.multi_modal_projector.linear_1.weight"] = torch.ones(64, 32)
    save_file(tensors, out / "model.safetensors")
    return out


@pytest.mark.parametrize(
    "mt,v,prefix,head",
    [
        ("ministral3", "plain", "model.language_model.", "lm_head.weight"),
        ("ministral3", "plain", "language_model.model.", "language_model.lm_head.weight"),
        ("mistral4", "plain", "model.language_model.", "lm_head.weight"),  # Mistral Small 4: latent attention, experts
        ("gemma4_text", "ple", "model.language_model.", "lm_head.weight"),  # Gemma 4 E2B: per-layer embeddings
    ],
)
def test_the_text_model_of_a_multimodal_checkpoint_is_the_text_only_model(tmp_path, capfd, mt, v, prefix, head):
    plain = tiny_hf(mt, v, tmp_path / "plain")
    wrapped = _wrap(plain, tmp_path / "wrapped", prefix, head)
    a, b = HFSource(plain), HFSource(wrapped)
    assert a.args == b.args
    for _, name in canonical_names(a.args):
        assert np.array_equal(a.get(name), b.get(name)), name
    convert(b, tmp_path / "store", "fp32")
    assert "mistral3 is a multimodal model: cadence converts and runs its text model; images are not run" in (
        capfd.readouterr().err
    )
