"""The fused expert kernel (csrc/experts.cpp): a block's routed experts in one call give bit for bit what the
expert-by-expert path gives, for experts at int8, int4 and int2 side by side, on every kernel path this host has;
and so for gpt-oss's experts (biases, the clamped SwiGLU) and Llama 4's (the routing weight scaling the input)."""

import dataclasses

import pytest
import torch

from models import expert_kernel, kernels, linear
from models.transformer import Transformer
from formats.weights import ExpertWeights, TensorWeights, random_tensors
from tests.models.test_kernel_paths import NAMES, path_lib
from tests.models.tiny_moe import ARCHS

D, F, E = 128, 96, 12


def _expert(e: int, fmt: str) -> ExpertWeights:
    g = torch.Generator().manual_seed(e)
    enc = lambda n, k: linear.decode(fmt, *linear.encode(torch.randn(n, k, generator=g) * 0.1, fmt))
    return ExpertWeights(enc(2 * F, D), enc(D, F))


EXPERTS = {e: _expert(e, ("int4", "int2", "int8")[e % 3]) for e in range(E)}


def one_by_one(h, ids, top, part, out):
    """The expert-by-expert path of Transformer.moe."""
    for e in part:
        rows, k = (ids == e).nonzero(as_tuple=True)
        x = EXPERTS[e]
        y = x.down.matmul(kernels.swiglu(x.gate_up.matmul(h.index_select(0, rows))))
        out.index_add_(0, rows, y * top[rows, k, None])
    return out


def _routing(T, k=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    top = torch.softmax(torch.randn(T, k, generator=g), -1)
    return ids, top


def _biased(e: int) -> ExpertWeights:
    x = _expert(e, ("int4", "int2", "int8")[e % 3])
    g = torch.Generator().manual_seed(100 + e)
    x.gate_up.bias, x.down.bias = torch.randn(2 * F, generator=g), torch.randn(D, generator=g) * 0.1
    return x


BIASED = {e: _biased(e) for e in range(E)}
ALPHA, LIMIT = 1.702, 0.9  # gpt-oss's alpha; a limit that clamps part of these gates and ups


def one_by_one_variant(h, ids, top, part, out, variant):
    """moe.py's expert-by-expert path on the kernels: gpt-oss's `ffn` (biases, `oai_glu`), or Llama 4's (x w in)."""
    for e in part:
        rows, k = (ids == e).nonzero(as_tuple=True)
        x, w = h.index_select(0, rows), top[rows, k, None]
        if variant == "gpt-oss":
            ex = BIASED[e]
            out.index_add_(0, rows, ex.down(expert_kernel.oai_glu(ex.gate_up(x), ALPHA, LIMIT)) * w)
        else:
            ex = EXPERTS[e]
            out.index_add_(0, rows, ex.down.matmul(kernels.swiglu(ex.gate_up.matmul(x * w))))
    return out


@pytest.mark.parametrize("variant", ["gpt-oss", "llama4"])
@pytest.mark.parametrize("T", [1, 7, 40])
def test_one_call_equals_expert_by_expert_with_biases_and_their_activation_or_a_scaled_input(path, T, variant):
    h = torch.randn(T, D, generator=torch.Generator().manual_seed(T)) * 2
    ids, top = _routing(T, seed=T)
    base = torch.randn(T, D, generator=torch.Generator().manual_seed(99))
    experts = BIASED if variant == "gpt-oss" else EXPERTS
    with kernels.using(path):
        for part in (tuple(range(E)), (1, 4, 5, 11)):
            ref = one_by_one_variant(h, ids, top, part, base.clone(), variant)
            table = torch.stack([experts[e].table for e in part])
            kw = (
                dict(biases=torch.stack([experts[e].biases for e in part]), oai=(ALPHA, LIMIT))
                if variant == "gpt-oss"
                else dict(scale_input=True)
            )
            got = expert_kernel.experts(h, ids, top, torch.tensor(part, dtype=torch.int32), table, base.clone(), **kw)
            assert torch.equal(got, ref), part


def test_the_clamped_swiglu_is_gpt_oss_s_within_rounding():
    """`oai_glu` against transformers' formula in torch: (clamp(up) + 1) * gate' sigmoid(alpha gate')."""
    gu = torch.randn(5, 2 * F, generator=torch.Generator().manual_seed(1)) * 3
    gate, up = gu.chunk(2, dim=-1)
    gate, up = gate.clamp(max=LIMIT), up.clamp(min=-LIMIT, max=LIMIT)
    ref = (up + 1) * (gate * torch.sigmoid(gate * ALPHA))
    assert torch.allclose(expert_kernel.oai_glu(gu, ALPHA, LIMIT), ref, rtol=1e-6, atol=1e-6)


@pytest.fixture(scope="module", params=NAMES)
def path(request):
    return path_lib(request.param)


@pytest.mark.parametrize("T", [1, 2, 7, 16, 40])
def test_one_call_equals_expert_by_expert(path, T):
    h = torch.randn(T, D, generator=torch.Generator().manual_seed(T)) * 2
    ids, top = _routing(T, seed=T)
    base = torch.randn(T, D, generator=torch.Generator().manual_seed(99))
    with kernels.using(path):
        for part in (tuple(range(E)), (1, 4, 5, 11)):  # the whole union; one part of it (a small expert buffer)
            ref = one_by_one(h, ids, top, part, base.clone())
            table = torch.stack([EXPERTS[e].table for e in part])
            got = expert_kernel.experts(h, ids, top, torch.tensor(part, dtype=torch.int32), table, base.clone())
            assert torch.equal(got, ref), part
            untouched = ~torch.isin(ids, torch.tensor(part)).any(-1)
            assert torch.equal(got[untouched], base[untouched])


def test_the_moe_forward_takes_one_call_per_part_and_gives_the_same_logits(monkeypatch):
    """A tiny int4 mixture of experts: the forward through the fused kernel equals the one through the
    expert-by-expert path, and calls the kernel once per layer."""
    args = dataclasses.replace(ARCHS["qwen3_moe"], n_layers=2)
    toks = torch.tensor([5, 77, 200, 12, 9, 150, 151, 2, 64, 33])

    def logits():  # fresh weights each time: an expert's table is computed once and kept
        model = Transformer(args, TensorWeights(args, random_tensors(args, seed=3, scale=1.5), fmt="int4"))
        return model.forward(toks, torch.arange(len(toks)), model.new_cache(16))

    calls = []
    real = expert_kernel.experts
    monkeypatch.setattr(expert_kernel, "experts", lambda *a: calls.append(1) or real(*a))
    fused = logits()
    assert len(calls) == args.n_layers
    monkeypatch.setattr(ExpertWeights, "table", None)  # no table: the expert-by-expert path
    assert torch.equal(logits(), fused)
    assert len(calls) == args.n_layers
