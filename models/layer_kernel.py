"""A dense decoder layer in one kernel call (csrc/layer.cpp): what `Transformer.block_fused` computes with
~10 calls, in one, with the same bits. It pays where a layer's products are small (a draft's one-token
step: the 0.5B's forward went from ~6.1 to ~4.5 ms), and costs nothing where they are large.

Layers it takes: quantized products (int8, int4, int2) with the kernel library, no q/k norms, a dense FFN
(not a mixture of experts, not LLM in a flash). Others go through the separate calls."""

from __future__ import annotations

import torch

from models import kernels, linear
from models.config import ModelArgs


def record(w, args: ModelArgs) -> torch.Tensor | None:
    """The layer as cad_layer reads it (int64), made once per weights object; None where it cannot take it."""
    rec = w.kernel_record
    if rec is None:
        rec = w.kernel_record = _record(w, args)
    return rec if rec.numel() else None


def _record(w, args: ModelArgs) -> torch.Tensor:
    lins = (w.qkv, w.attn_out, w.gate_up, w.down)
    plain = w.flash is None and w.router is None and w.q_norm is None and w.k_norm is None
    plain = plain and not args.moe and not args.qk_norm
    if not plain or not all(isinstance(x, linear.QuantLinear) and x.kernel for x in lins):
        return torch.empty(0, dtype=torch.int64)
    tensors = [w.attn_norm, w.ffn_norm] + ([] if w.qkv.bias is None else [w.qkv.bias])
    if any(t.dtype != torch.float32 or not t.is_contiguous() for t in tensors):
        return torch.empty(0, dtype=torch.int64)
    qkv = (args.n_heads + 2 * args.n_kv_heads) * args.head_dim
    want = (args.dim, qkv, args.q_dim, args.dim, args.dim, 2 * w.down.k, args.dim)  # the shapes cad_layer assumes
    if (w.qkv.k, w.qkv.n, w.attn_out.k, w.attn_out.n, w.gate_up.k, w.gate_up.n, w.down.n) != want:
        return torch.empty(0, dtype=torch.int64)
    bias = 0 if w.qkv.bias is None else w.qkv.bias.data_ptr()
    head = [args.dim, args.n_heads, args.n_kv_heads, args.head_dim, w.down.k]
    head += [w.attn_norm.data_ptr(), w.ffn_norm.data_ptr(), bias]
    return torch.tensor(head + [v for x in lins for v in x.record()], dtype=torch.int64)


def run(
    rec: torch.Tensor, x: torch.Tensor, positions: torch.Tensor, rotary, cache, i: int, vis, scale: float, eps: float
):
    """x [T, dim] (fp32, contiguous) through layer i in place; its keys and values go to cache slots
    [cache.end, cache.end + T) (`positions`: int64 [T], the rotary tables grown to cover them)."""
    assert vis.ptr.dtype == torch.int32 and vis.idx.dtype == torch.int32 and vis.ptr.numel() == x.shape[0] + 1
    layer = cache.k.stride(0) * cache.k.element_size() * i
    kernels.lib().cad_layer(
        rec.data_ptr(),
        x.data_ptr(),
        x.shape[0],
        positions.data_ptr(),
        rotary.cos.data_ptr(),
        rotary.sin.data_ptr(),
        cache.k.data_ptr() + layer,
        cache.v.data_ptr() + layer,
        cache.capacity,
        cache.end,
        vis.n_shared,
        vis.ptr.data_ptr(),
        vis.idx.data_ptr(),
        scale,
        eps,
        torch.get_num_threads(),
    )
    return x
