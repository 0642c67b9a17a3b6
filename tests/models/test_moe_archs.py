"""Qwen3, Qwen2-MoE, Qwen3-MoE, OLMoE and Mixtral, read from HF directories and GGUF files, against HF transformers."""

import dataclasses

import pytest
import torch

from formats.convert import convert
from formats.source import GGUFSource
from formats.source_hf import HFSource
from formats.store import WeightStore
from models.transformer import Transformer
from formats.weights import ResidentWeights, TensorWeights, random_tensors
from tests.models.tiny_moe import ARCHS, write_gguf, write_hf

IDS = torch.tensor([5, 77, 300, 12, 9, 150, 151, 2, 64, 33, 260, 101, 7, 7, 45, 200, 18, 99, 250, 3])


@pytest.fixture(scope="module", params=list(ARCHS))
def arch(request, tmp_path_factory):
    args = ARCHS[request.param]
    t = random_tensors(args, seed=5, scale=1.5)
    d = tmp_path_factory.mktemp(request.param)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(write_hf(d / "hf", args, t), dtype=torch.float32).eval()
    return args, t, d, hf


def ours(store_dir):
    st = WeightStore(store_dir)
    return Transformer(st.args, ResidentWeights(st))


def greedy(step, n=16):
    ids = IDS[:6].tolist()
    for _ in range(n):
        ids.append(int(step(torch.tensor(ids)).argmax()))
    return ids[6:]


def test_hf_directory_and_gguf_read_the_same_model(arch):
    args, t, d, _ = arch
    hf_src, gg_src = HFSource(d / "hf"), GGUFSource(write_gguf(d / "m.gguf", args, t))
    assert hf_src.args == args
    assert dataclasses.replace(gg_src.args, norm_eps=args.norm_eps, context_length=args.context_length) == args
    for name in ("blk.1.attn_qkv", "blk.0.ffn_norm", "blk.1.attn_out") + (
        ("blk.1.ffn_router", "blk.0.exp.3.gate_up", "blk.1.exp.2.down") if args.moe else ()
    ):
        assert torch.equal(torch.from_numpy(hf_src.get(name)), t[name]), name
        assert torch.equal(torch.from_numpy(gg_src.get(name)), t[name]), name


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_logits_within_1e4_of_transformers_and_greedy_identical(arch, source):
    args, t, d, hf = arch
    src = (
        HFSource(d / "hf")
        if source == "hf"
        else GGUFSource(d / "m.gguf" if (d / "m.gguf").exists() else write_gguf(d / "m.gguf", args, t))
    )
    model = ours(convert(src, d / f"store-{source}", "fp32"))
    with torch.no_grad():
        ref = hf(IDS[None]).logits[0]
    got = model.forward(IDS, torch.arange(len(IDS)), model.new_cache(32))
    assert (got - ref).abs().max() < 1e-4, float((got - ref).abs().max())

    def ours_step(ids):
        return model.forward(ids, torch.arange(len(ids)), model.new_cache(32))[-1]

    with torch.no_grad():
        assert greedy(ours_step) == greedy(lambda ids: hf(ids[None]).logits[0, -1])


@pytest.mark.parametrize("name", [n for n, a in ARCHS.items() if a.moe])
def test_a_moe_layer_asks_for_the_union_of_its_rows_experts_and_a_row_routes_as_it_does_alone(name):
    args = ARCHS[name]
    t = random_tensors(args, seed=5, scale=1.5)
    w = TensorWeights(args, t)
    model = Transformer(args, w)
    cache = model.new_cache(32)
    steps = model.forward_steps(IDS[:8], torch.arange(8), cache)
    need, asked = next(steps), []
    try:
        while True:
            if hasattr(need, "experts"):
                asked.append(need)
            from models.requests import weights_for

            need = steps.send(weights_for(w, need))
    except StopIteration as done:
        block = done.value
    assert [n.layer for n in asked] == list(range(args.n_layers))
    assert all(list(n.experts) == sorted(set(n.experts)) and len(n.experts) >= args.n_experts_used for n in asked)
    assert (
        sum(len(n.experts) for n in asked) > args.n_layers * args.n_experts_used
    )  # 8 tokens use more than one token's experts
    alone = torch.stack([model.forward(IDS[: i + 1], torch.arange(i + 1), model.new_cache(32))[-1] for i in range(8)])
    assert torch.equal(block, alone)
