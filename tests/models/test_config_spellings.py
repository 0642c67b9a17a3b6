"""Issue 24: transformers 5 renames config keys when it saves a model (Qwen3-MoE's expert count became
num_local_experts, rope_theta moved into rope_parameters, a sliding window into layer_types), and a Qwen3-MoE
it wrote was read as a dense model. Every architecture's HF directory, in the spelling transformers 4 wrote
and in the one the installed transformers 5 writes, reads to the same ModelArgs and runs to the same logits."""

import dataclasses
import json
import shutil

import pytest
import torch

from formats.convert import convert
from formats.source_hf import HFSource
from formats.store import WeightStore
from models.transformer import Transformer
from formats.weights import ResidentWeights, random_tensors
from tests.conftest import TINY
from tests.models.tiny_files import write_hf_dir
from tests.models.tiny_moe import ARCHS, write_hf

# rope_theta and rms_norm_eps away from every class default: a spelling read wrong changes the logits
SHAPES = {"llama": TINY["llama"], "qwen2": TINY["qwen"], **ARCHS}
IDS = torch.tensor([5, 77, 200, 12, 9, 150, 151, 2, 64, 33])


def written(arch: str, tmp_path, **config):
    """(args, the directory as transformers 4 wrote it, the same model saved by transformers 5)."""
    from transformers import AutoConfig

    args = dataclasses.replace(SHAPES[arch], rope_base=500000.0, norm_eps=2e-5)
    t = random_tensors(args, seed=7, scale=1.5)
    v4 = (write_hf_dir if arch in ("llama", "qwen2") else write_hf)(tmp_path / "v4", args, t)
    if config:
        (v4 / "config.json").write_text(json.dumps({**json.loads((v4 / "config.json").read_text()), **config}))
    v5 = shutil.copytree(v4, tmp_path / "v5")
    AutoConfig.from_pretrained(v4).save_pretrained(v5)  # rewrites config.json as transformers 5 spells it
    return args, v4, v5


def logits(src: HFSource, out) -> torch.Tensor:
    st = WeightStore(convert(src, out, "fp32"))
    model = Transformer(st.args, ResidentWeights(st))
    with torch.no_grad():
        return model.forward(IDS, torch.arange(len(IDS)), model.new_cache(16))


@pytest.mark.parametrize("arch", list(SHAPES))
def test_transformers_4_and_5_spellings_read_and_run_the_same(arch, tmp_path):
    args, v4, v5 = written(arch, tmp_path)
    cfg4, cfg5 = (json.loads((d / "config.json").read_text()) for d in (v4, v5))
    assert "rope_theta" in cfg4 and "rope_theta" not in cfg5 and cfg5["rope_parameters"]["rope_theta"] == 500000.0
    if arch == "qwen3_moe":  # the spelling that was read as a dense model
        assert "num_experts" not in cfg5 and cfg5["num_local_experts"] == args.n_experts
    src4, src5 = HFSource(v4), HFSource(v5)
    assert src4.args == src5.args == args
    assert torch.equal(logits(src4, tmp_path / "s4"), logits(src5, tmp_path / "s5"))


@pytest.mark.parametrize(
    "arch,config",
    [
        ("qwen2", {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 0}),  # 5 writes layer_types
        ("mixtral", {"sliding_window": 64}),
    ],
)
def test_a_sliding_window_in_either_spelling_slides_the_same_layers(arch, config, tmp_path):
    """The window and the layers it covers read the same from either spelling; the context stays the model's (a
    sliding layer keeps only its window's rows: models/kvcache.py)."""
    args, v4, v5 = written(arch, tmp_path, **config)
    a4, a5 = HFSource(v4).args, HFSource(v5).args
    assert a4.sliding_window == a5.sliding_window == 64
    assert a4.sliding_layers == a5.sliding_layers == tuple(range(args.n_layers))
    assert a4.context_length == a5.context_length == args.context_length > 64
