"""The canonical attention kernel: right against SDPA, and a row's output independent of its batch."""

import math

import pytest
import torch
import torch.nn.functional as F

from common.errors import CadenceError
from models import kernels
from models import split_attention
from models.attention import Visibility, attend


def _reference(q, kc, vc, mask, scale):
    H, Hkv = q.shape[1], kc.shape[0]
    n = mask.shape[1]
    k = kc[:, :n].repeat_interleave(H // Hkv, 0)
    v = vc[:, :n].repeat_interleave(H // Hkv, 0)
    return (
        F.scaled_dot_product_attention(q.transpose(0, 1).double(), k.double(), v.double(), attn_mask=mask, scale=scale)
        .transpose(0, 1)
        .float()
    )


def _random_tree(n, g):
    return [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]


@pytest.mark.parametrize("H,Hkv,D", [(4, 2, 16), (12, 2, 128), (9, 3, 64), (14, 2, 64), (3, 3, 24)])
@pytest.mark.parametrize("ctx", [0, 1, 31, 32, 33, 100])
def test_tree_attention_matches_dense_masked_sdpa(H, Hkv, D, ctx):
    g = torch.Generator().manual_seed(H * 1000 + ctx)
    T = 13
    kc, vc = torch.randn(Hkv, ctx + T + 5, D, generator=g), torch.randn(Hkv, ctx + T + 5, D, generator=g)
    q = torch.randn(T, H, D, generator=g)
    vis = Visibility.tree(ctx, _random_tree(T, g))
    scale = 1 / math.sqrt(D)
    out = kernels.attention(q, kc, vc, vis.n_shared, vis.ptr, vis.idx, scale)
    ref = _reference(q, kc, vc, vis.dense_mask(ctx + T), scale)
    assert (out - ref).abs().max() < 1e-5


def test_lse_is_log_of_softmax_denominator():
    g = torch.Generator().manual_seed(1)
    q, kc, vc = (
        torch.randn(3, 2, 16, generator=g),
        torch.randn(2, 40, 16, generator=g),
        torch.randn(2, 40, 16, generator=g),
    )
    vis = Visibility.causal(37, 3)
    _, lse = kernels.attention(q, kc, vc, vis.n_shared, vis.ptr, vis.idx, 0.25, want_lse=True)
    s = torch.einsum("thd,hsd->ths", q, kc.repeat_interleave(1, 0)) * 0.25
    mask = vis.dense_mask(40)
    ref = torch.logsumexp(s.masked_fill(~mask[:, None, :], float("-inf")), dim=-1)
    assert (lse - ref).abs().max() < 1e-5


def test_sinks_join_each_softmax_s_denominator_and_a_tree_row_keeps_its_alone_bits():
    """gpt-oss's sinks: a logit per head in the softmax's denominator only, against the scores written out with the
    sink as one more column; a tree's rows get the bits each gets decoded alone."""
    g = torch.Generator().manual_seed(2)
    H, Hkv, D, ctx, T = 4, 2, 16, 37, 6
    kc, vc = torch.randn(Hkv, ctx + T, D, generator=g), torch.randn(Hkv, ctx + T, D, generator=g)
    q, sinks = torch.randn(T, H, D, generator=g), torch.randn(H, generator=g) * 2
    parents = [-1, 0, 0, 1, 3, 2]
    vis = Visibility.tree(ctx, parents)
    out = kernels.attention(q, kc, vc, vis.n_shared, vis.ptr, vis.idx, 0.25, sinks=sinks)
    k, v = kc.repeat_interleave(H // Hkv, 0).double(), vc.repeat_interleave(H // Hkv, 0).double()
    s = torch.einsum("thd,hsd->ths", q.double(), k) * 0.25
    s = s.masked_fill(~vis.dense_mask(ctx + T)[:, None, :], float("-inf"))
    p = torch.softmax(torch.cat([s, sinks.double().view(1, H, 1).expand(T, H, 1)], -1), -1)[..., :-1]
    assert (out.double() - torch.einsum("ths,hsd->thd", p, v)).abs().max() < 1e-5
    for r in range(T):  # row r alone: its path's keys, in order
        path, at = [], r
        while at >= 0:
            path.insert(0, ctx + at)
            at = parents[at]
        one = Visibility(ctx, torch.tensor([0, len(path)], dtype=torch.int32), torch.tensor(path, dtype=torch.int32))
        alone = kernels.attention(q[r : r + 1].contiguous(), kc, vc, one.n_shared, one.ptr, one.idx, 0.25, sinks=sinks)
        assert torch.equal(alone[0], out[r])


@pytest.mark.parametrize("H,Hkv,D", [(12, 2, 64), (14, 2, 128), (6, 2, 48)])
def test_row_output_does_not_depend_on_the_batch(H, Hkv, D):
    """A tree node attended in a batch == the same node decoded alone on its path (bit for bit). Where D is a
    multiple of 64 the kernel takes two queries at a time (`chunk2`), which pairs different queries alone
    and in a batch (an odd group of 7 heads a KV head, too)."""
    g = torch.Generator().manual_seed(7)
    ctx, T = 70, 20
    kc, vc = torch.randn(Hkv, ctx + T, D, generator=g), torch.randn(Hkv, ctx + T, D, generator=g)
    q = torch.randn(T, H, D, generator=g)
    parents = _random_tree(T, g)
    tree = Visibility.tree(ctx, parents)
    batched = kernels.attention(q, kc, vc, tree.n_shared, tree.ptr, tree.idx, 0.125)
    for r in range(T):
        path = tree.idx[tree.ptr[r] : tree.ptr[r + 1]]
        # Lay the path out as a plain sequence after the context, as single-token decoding would.
        ks, vs = kc.clone(), vc.clone()
        ks[:, ctx : ctx + len(path)] = kc[:, path.long()]
        vs[:, ctx : ctx + len(path)] = vc[:, path.long()]
        pos = ctx + len(path) - 1
        alone = kernels.attention(
            q[r : r + 1].contiguous(),
            ks,
            vs,
            pos,
            torch.tensor([0, 1], dtype=torch.int32),
            torch.tensor([pos], dtype=torch.int32),
            0.125,
        )
        assert torch.equal(alone[0], batched[r]), f"node {r}"


def test_from_mask_agrees_with_tree():
    parents = [-1, 0, 0, 1, 2, 2, 5]
    tree = Visibility.tree(10, parents)
    again = Visibility.from_mask(tree.dense_mask(17))
    assert again.n_shared == 11  # the root is seen by every node, so it joins the shared prefix
    assert torch.equal(again.dense_mask(17), tree.dense_mask(17))
    g = torch.Generator().manual_seed(0)
    q, kc, vc = (
        torch.randn(7, 2, 16, generator=g),
        torch.randn(2, 17, 16, generator=g),
        torch.randn(2, 17, 16, generator=g),
    )
    assert torch.equal(attend(q, kc, vc, tree, 0.3), attend(q, kc, vc, again, 0.3))


def _as(kv: str, cache: torch.Tensor) -> torch.Tensor:
    """A float cache [Hkv, cap, D] in --kv-dtype kv."""
    if kv != "q8":
        return cache.half() if kv == "f16" else cache
    rows = torch.empty(*cache.shape[:2], cache.shape[2] // 32 * 34, dtype=torch.uint8)
    for h in range(cache.shape[0]):
        kernels.q8_rows(cache[h].contiguous(), rows[h])
    return rows


@pytest.mark.parametrize("kv", ["f32", "f16", "q8"])
def test_torch_fallback_agrees_with_kernel(monkeypatch, kv):
    """The torch path (CUDA, no compiler) reads a float or half cache as the kernel does; a q8 cache, which only
    the kernels read, is refused there in one sentence."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(6, 4, 32, generator=g)
    kc, vc = _as(kv, torch.randn(2, 30, 32, generator=g)), _as(kv, torch.randn(2, 30, 32, generator=g))
    vis = Visibility.tree(20, [-1, 0, 1, 0, 3, 3])
    fast = attend(q, kc, vc, vis, 0.2)
    monkeypatch.setattr(kernels, "available", lambda: False)
    if kv == "q8":
        with pytest.raises(CadenceError, match="q8 runs on cadence's CPU kernels"):
            attend(q, kc, vc, vis, 0.2)
        return
    slow = attend(q, kc, vc, vis, 0.2)
    assert (fast - slow).abs().max() < 1e-5


def test_a_half_cache_attends_as_a_float_cache_of_its_values():
    """--kv-dtype f16: the kernels widen each key and value exactly, so attention over a half cache is, to the bit,
    attention over a float cache holding the same (rounded) values, in every form (whole, dense part, chunk states);
    and the fused write rounds a key to nearest as torch's .half() does."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(5, 8, 64, generator=g)
    kc, vc = torch.randn(2, 100, 64, generator=g).half(), torch.randn(2, 100, 64, generator=g).half()
    vis = Visibility.tree(70, [-1, 0, 0, 1, 2])
    assert torch.equal(attend(q, kc, vc, vis, 0.125), attend(q, kc.float(), vc.float(), vis, 0.125))
    half, full = (
        split_attention.attn_dense(q, kc, vc, 0, 2, 0.125),
        split_attention.attn_dense(q, kc.float(), vc.float(), 0, 2, 0.125),
    )
    assert all(torch.equal(a, b) for a, b in zip(half, full))
    args = (70, vis.ptr, vis.idx, 64, 0.125)
    assert torch.equal(
        split_attention.attn_chunks(q, kc, vc, *args)[0],
        split_attention.attn_chunks(q, kc.float(), vc.float(), *args)[0],
    )
    qkv, pos = torch.randn(5, 12 * 64, generator=g), torch.arange(5, dtype=torch.int64) + 3
    cos, sin = torch.randn(20, 64, generator=g), torch.randn(20, 64, generator=g)
    kh, vh = torch.zeros(2, 100, 64, dtype=torch.float16), torch.zeros(2, 100, 64, dtype=torch.float16)
    kf, vf = torch.zeros(2, 100, 64), torch.zeros(2, 100, 64)
    assert torch.equal(
        kernels.qkv_rope(qkv, None, pos, cos, sin, kh, vh, 8, 10),
        kernels.qkv_rope(qkv, None, pos, cos, sin, kf, vf, 8, 10),
    )
    assert torch.equal(kh, kf.half()) and torch.equal(vh, vf.half()) and kh[:, 10:15].abs().sum() > 0


def test_q8_rows_are_llama_cpp_s_q8_0_and_attend_as_their_values():
    """--kv-dtype q8: a row is llama.cpp's q8_0 blocks to the byte (gguf-py's bit-exact copy of its reference
    quantizer as the oracle), read back as its dequantized floats; the attention over a q8 cache is, to the bit,
    the attention over a float cache of those values; the fused write quantizes as the kernels' own rows do."""
    from gguf.quants import GGMLQuantizationType, quantize

    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 100, 64, generator=g) * torch.rand(2, 100, 1, generator=g) * 4
    x[0, 3, :32] = 0  # a block of zeros: scale 0
    rows = torch.empty(2, 100, 68, dtype=torch.uint8)
    for h in range(2):
        kernels.q8_rows(x[h].contiguous(), rows[h])
    ref = quantize(x.numpy(), GGMLQuantizationType.Q8_0)
    assert torch.equal(rows, torch.from_numpy(ref).view(2, 100, 68))
    values = torch.stack([kernels.q8_floats(rows[h], 64) for h in range(2)])
    assert (values - x).abs().max() < x.abs().max() / 127
    vrows = rows.flip(1).contiguous()  # other rows as the values
    vvals = torch.stack([kernels.q8_floats(vrows[h], 64) for h in range(2)])
    q, vis = torch.randn(5, 8, 64, generator=g), Visibility.tree(70, [-1, 0, 0, 1, 2])
    assert torch.equal(attend(q, rows, vrows, vis, 0.125), attend(q, values, vvals, vis, 0.125))
    qkv, pos = torch.randn(5, 12 * 64, generator=g), torch.arange(5, dtype=torch.int64) + 3
    cos, sin = torch.randn(20, 64, generator=g), torch.randn(20, 64, generator=g)
    kq, vq = torch.zeros(2, 100, 68, dtype=torch.uint8), torch.zeros(2, 100, 68, dtype=torch.uint8)
    kf, vf = torch.zeros(2, 100, 64), torch.zeros(2, 100, 64)
    kernels.qkv_rope(qkv, None, pos, cos, sin, kq, vq, 8, 10)
    kernels.qkv_rope(qkv, None, pos, cos, sin, kf, vf, 8, 10)
    for h in range(2):
        for cache, floats in ((kq, kf), (vq, vf)):
            want = torch.empty(5, 68, dtype=torch.uint8)
            kernels.q8_rows(floats[h, 10:15].contiguous(), want)
            assert torch.equal(cache[h, 10:15], want)
