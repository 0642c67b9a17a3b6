"""The 2026 mixtures of experts over the actors (tiny random models built by transformers: gpt-oss, Qwen 3.5's,
Qwen3-Next, LFM2-MoE, GLM-4.5, Llama 4, Mistral 4, Gemma 4's 26B):
their layers and experts streamed from disk through the loader, `tree` and `chain` give the target's own tokens;
and gpt-oss's released MXFP4 expert blocks read as transformers dequantizes them."""

import dataclasses

import numpy as np
import pytest
import torch

from common.settings import SamplingConfig
from formats import loading
from formats.convert import convert
from formats.source_hf import HFSource
from formats.store import WeightStore
from scheduler.generation.memplan import Overheads, plan_memory, smallest_budget
from speculative.generate import generate_target
from tests.models.families import tiny_hf
from tests.scheduler.test_experts_tiny import run

N = 32


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return tiny_hf("gpt_oss", "plain", tmp_path_factory.mktemp("gpt_oss") / "hf", seed=1)


@pytest.mark.parametrize(
    "mt,v",
    [
        *[(mt, "plain") for mt in ("gpt_oss", "qwen3_5_moe_text", "qwen3_next", "lfm2_moe", "glm4_moe", "llama4_text")],
        ("mistral4", "plain"),
        ("gemma4_text", "moe"),  # GeGLU experts beside a dense MLP, with norms and a router of their own
    ],
)
def test_tree_and_chain_are_the_target_with_layers_and_experts_streamed(tmp_path, mt, v):
    store = WeightStore(convert(HFSource(tiny_hf(mt, v, tmp_path / "hf", seed=1)), tmp_path / "int4", "int4"))
    g = torch.Generator().manual_seed(3)
    base = torch.randint(3, 300, (12,), generator=g).tolist()
    prompt = base + base[:6]  # past the sliding window of 8
    reference = generate_target(loading.load_store(store), prompt, N, SamplingConfig(), stop_at_eos=False).new_ids
    groups = {n: store.groups[n].nbytes for n in store.group_names() if n.startswith(("layer.", "head."))}
    experts = {n: store.groups[n].nbytes for n in store.group_names() if n.startswith("expert.")}
    o = Overheads(**{f.name: 0 for f in dataclasses.fields(Overheads)})
    k = store.args.n_experts_used
    budget = smallest_budget(groups, 0, 0, 0, overheads=o, experts=experts, experts_used=k) + 4096
    plan = plan_memory(budget, groups, 0, 0, 0, overheads=o, experts=experts, experts_used=k)
    assert plan.streamed
    for mode in ("tree", "chain"):
        s, spec = run(store, plan, mode=mode, draft=store)
        try:
            got = spec.loop.generate(prompt, N, set())
            assert got.new_ids == reference, mode
            assert got.stats["accepted"] > 0 and got.stats["loads"] > 0 and got.stats["expert_reads"] > 0, got.stats
        finally:
            spec.close()
            s.shutdown()


def test_mxfp4_expert_blocks_read_as_transformers_dequantizes_them(hf_dir, tmp_path):
    """The experts as the released checkpoints keep them: 4-bit E2M1 values in blocks of 32, a power-of-two scale a
    block, [experts, out, groups, 16] bytes; each expert's rows are transformers' own dequantization, transposed
    to [out, in] with the gate rows first."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    d = shutil.copytree(hf_dir, tmp_path / "mxfp4")
    t = load_file(d / "model.safetensors")
    g = torch.Generator().manual_seed(7)
    packed = {}
    for name in [k for k in t if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, k_in, n_out = t.pop(name).shape
        blocks = torch.randint(0, 256, (e, n_out, k_in // 32, 16), generator=g, dtype=torch.uint8)
        scales = torch.randint(120, 131, (e, n_out, k_in // 32), generator=g, dtype=torch.uint8)
        t[f"{name}_blocks"], t[f"{name}_scales"] = blocks, scales
        packed[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [e, in, out], as HF runs it
    save_file(t, d / "model.safetensors")
    src = HFSource(d)
    for e in range(src.args.n_experts):
        gu = packed["model.layers.1.mlp.experts.gate_up_proj"][e].T.numpy()
        assert np.array_equal(src.get(f"blk.1.exp.{e}.gate_up"), np.concatenate([gu[0::2], gu[1::2]]))
        dn = packed["model.layers.0.mlp.experts.down_proj"][e].T.numpy()
        assert np.array_equal(src.get(f"blk.0.exp.{e}.down"), dn)
