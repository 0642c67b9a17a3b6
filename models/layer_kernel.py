"""A dense decoder layer in one kernel call (csrc/layer.cpp): what `Transformer.block_fused` computes with
~10 calls, in one, with the same bits. It pays where a layer's products are small (a draft's one-token
step; BENCHMARKS.md, "One kernel call a layer, and the attention's arithmetic"), and costs nothing where they
are large.

Layers it takes: quantized products (int8, int4, int2) with the kernel library and a dense FFN (not LLM in a
flash), of every family's block (norms before and/or after each branch, q/k norms and Gemma 4's weightless v norm,
SwiGLU or GeGLU, a residual scale, soft-capped attention, queries scaled by position and L2-normed, attention
sinks and an output bias, a layer's output scalar), full-attention, sliding-window or chunked alike, each layer
at its own head size. Of a layer of experts, its attention branch (the caller runs the experts: models/moe.py).
Others go through the separate calls."""

from __future__ import annotations

import struct

import torch

from models import kernels, linear
from models.args import ModelArgs


def record(w, args: ModelArgs, i: int) -> torch.Tensor | None:
    """Layer i as cad_layer reads it (int64), made once per weights object; None where it cannot take it."""
    rec = w.kernel_record
    if rec is None:
        rec = w.kernel_record = _record(w, args, i)
    return rec if rec.numel() else None


def _record(w, args: ModelArgs, i: int) -> torch.Tensor:
    experts = args.experts_at(i)  # a layer of experts: the kernel runs its attention, the caller its experts
    lins = (w.qkv, w.attn_out) if experts else (w.qkv, w.attn_out, w.gate_up, w.down)
    # through the separate calls: a recurrent layer, an attention gated by its input (Qwen 3.5), q/k norms over a
    # biased projection (the kernel adds the bias after them), relu^2 MLPs, experts beside a dense MLP or a layer's
    # ending (Gemma 4), Gemma 4's per-layer embeddings and shared keys
    biased_norm = args.qk_norm in ("head", "full") and w.qkv is not None and w.qkv.bias is not None
    ffn = (
        (not args.experts_beside_dense and not args.layer_end) if experts else w.router is None and args.act != "relu2"
    )
    dense = ffn and w.flash is None and w.attn_gate is None and not biased_norm
    dense = dense and not (args.ple_dim or args.kv_shared or args.recurrent(i))  # (Falcon-H1: a mixer beside it)
    dense = dense and not (args.v_norm and not args.qk_norm)  # (the values are normed with the queries and keys)
    if not dense or not all(isinstance(x, linear.QuantLinear) and x.kernel for x in lins):
        return torch.empty(0, dtype=torch.int64)
    norms = (w.attn_norm, w.ffn_norm, w.q_norm, w.k_norm, w.attn_post_norm, w.ffn_post_norm, w.qkv.bias, w.layer_scale)
    norms += (w.attn_sinks, w.attn_out.bias)
    if any(t is not None and (t.dtype != torch.float32 or not t.is_contiguous()) for t in norms):
        return torch.empty(0, dtype=torch.int64)
    hd, kv_heads = args.head_dim_at(i), args.kv_heads_at(i)  # (Gemma 4: a full-attention layer's own)
    q_dim, F = args.n_heads * hd, 0 if experts else w.down.k
    want = (args.dim, q_dim + 2 * kv_heads * hd, q_dim, args.dim, args.dim, 2 * F, args.dim)  # cad_layer's shapes
    have = (w.qkv.k, w.qkv.n, w.attn_out.k, w.attn_out.n) + (
        want[4:] if experts else (w.gate_up.k, w.gate_up.n, w.down.n)
    )
    if have != want or (w.layer_scale is not None and w.layer_scale.numel() != 1):
        return torch.empty(0, dtype=torch.int64)
    flags = (w.attn_norm is None) | (args.act == "gelu_tanh") << 1 | {"head": 1, "full": 2}.get(args.qk_norm, 0) << 2
    flags |= bool(args.v_norm) << 4 | experts << 5 | args.l2_at(i) << 6
    ptr = lambda t: 0 if t is None else t.data_ptr()
    head = [args.dim, args.n_heads, kv_heads, hd, F, *map(ptr, norms[:2]), ptr(w.qkv.bias)]
    head += [
        flags,
        *map(ptr, norms[2:6]),
        double_bits(args.residual_scale),
        double_bits(args.attn_softcap),
        *map(ptr, norms[7:]),
    ]
    quants = [v for x in lins for v in x.record()] + [0] * (18 if experts else 0)  # (no FFN products: zeros)
    return torch.tensor(head + quants, dtype=torch.int64)


def double_bits(x: float) -> int:
    """A float as the int64 of its double's bits (the record is int64; cad_layer reads it back)."""
    return struct.unpack("<q", struct.pack("<d", x))[0]


def run(rec: torch.Tensor, x: torch.Tensor, positions: torch.Tensor, at, scale: float, eps: float, qscale=None):
    """x [T, dim] (fp32, contiguous) through a layer in place; its keys and values go to the layer's cache
    rows from `at.slot0` (`at`: models/transformer.py `Place`; `positions`: int64 [T], the rotary tables
    grown to cover them; `qscale`: fp32 [T], each row's factor on its queries, or None: models/block_parts.py
    `query_scales`)."""
    vis = at.vis
    assert vis.ptr.dtype == torch.int32 and vis.idx.dtype == torch.int32 and vis.ptr.numel() == x.shape[0] + 1
    assert at.k.is_contiguous() and at.v.is_contiguous()
    kernels.lib().cad_layer(
        rec.data_ptr(),
        x.data_ptr(),
        x.shape[0],
        positions.data_ptr(),
        _ptr(qscale, x.shape[0]),
        at.rotary.cos.data_ptr(),
        at.rotary.sin.data_ptr(),
        at.k.data_ptr(),
        at.v.data_ptr(),
        at.k.shape[1],
        at.slot0,
        vis.n_shared,
        vis.ptr.data_ptr(),
        vis.idx.data_ptr(),
        scale,
        eps,
        kernels.kv_kind(at.k),
        torch.get_num_threads(),
    )
    return x


def run_many(
    rec: torch.Tensor,
    x: torch.Tensor,
    positions: torch.Tensor,
    places: list,
    spans: list,
    scale: float,
    eps: float,
    qscale=None,
):
    """`run` over several generations' rows at once (models/batch.py): x [T, dim] holds each generation's rows at
    its span (lo, hi), `positions` int64 [T] theirs, `places` each one's `Place` in this layer."""
    gens = []
    for (lo, hi), at in zip(spans, places):
        vis = at.vis
        assert vis.ptr.dtype == torch.int32 and vis.idx.dtype == torch.int32 and vis.ptr.numel() == hi - lo + 1
        assert at.k.is_contiguous() and at.v.is_contiguous()
        rot = at.rotary
        gens += (lo, hi, rot.cos.data_ptr(), rot.sin.data_ptr(), at.k.data_ptr(), at.v.data_ptr(), at.k.shape[1])
        gens += (at.slot0, vis.n_shared, vis.ptr.data_ptr(), vis.idx.data_ptr(), kernels.kv_kind(at.k))
    table = torch.tensor(gens, dtype=torch.int64)
    kernels.lib().cad_layer_many(
        rec.data_ptr(),
        x.data_ptr(),
        x.shape[0],
        positions.data_ptr(),
        _ptr(qscale, x.shape[0]),
        len(spans),
        table.data_ptr(),
        scale,
        eps,
        torch.get_num_threads(),
    )
    return x


def _ptr(qscale: torch.Tensor | None, T: int) -> int:
    """The address of a row factor tensor (fp32 [T], contiguous), 0 for none."""
    if qscale is None:
        return 0
    assert qscale.dtype == torch.float32 and qscale.is_contiguous() and qscale.numel() == T
    return qscale.data_ptr()
