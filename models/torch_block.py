"""The layer in torch ops, for devices other than the CPU (the CPU runs `Transformer.block_fused` on cadence's
kernels): the same block, a generator of weight requests like it. Also the norms and the rotation both paths share."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from common.errors import CadenceError
from models import block_parts, moe
from models.attention import attend, store
from models.block_parts import l2_norm


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin


def block(model, i: int, w, x: torch.Tensor, positions: torch.Tensor, at):
    """The torch-ops layer (devices other than the CPU): a generator like `block_fused`."""
    a = model.args
    T = x.shape[0]
    if not a.attends(i):
        x = x.clone()
        if a.recurrent(i):
            model.mixer(x, w, at, rms_norm)
        return (yield from ffn_branch(model, i, w, x, at.ple))
    hn = model.pre(x, w.attn_norm, rms_norm)
    if at.rec is not None:  # a Mamba-2 mixer beside the attention, on the same normed input (Falcon-H1)
        hn, x = (x.clone() if hn is x else hn), x.clone()
        model.mixer(x, w, at.rec, rms_norm, hn)
    cos, sin = at.rotary.tables(positions)
    qkv = w.qkv(hn) if w.mla_kv_a is None else model.project(w, hn, rms_norm)[0]
    if a.qk_norm in ("head", "full"):
        model.norm_qk(qkv, w, rms_norm, i)
    hd, hkv, q_dim = a.head_dim_at(i), a.kv_heads_at(i), a.q_dim_at(i)
    q = block_parts.temper(model, rope(qkv[:, :q_dim].reshape(T, a.n_heads, hd), cos, sin), positions, i)
    if not a.shares_kv(i):  # (Gemma 4's last layers attend over an earlier layer's keys and values)
        k, v = qkv[:, q_dim:].split(hkv * hd, dim=-1)
        k = rope(k.reshape(T, hkv, hd), cos, sin)
        k = l2_norm(k, a.norm_eps) if a.l2_at(i) else k
        store(at.k, at.slot0, k)
        store(at.v, at.slot0, v.reshape(T, hkv, hd))
    o = attend(q, at.k, at.v, at.vis, model.scale, a.attn_softcap, w.attn_sinks)  # [T, H, D]
    x = x.clone() if at.rec is None else x  # (beside a mixer: cloned above)
    model.residual(x, w.attn_out, model.gated(o.reshape(T, -1), w, hn), w.attn_post_norm, rms_norm)
    return (yield from ffn_branch(model, i, w, x, at.ple))


def ffn_branch(model, i: int, w, x: torch.Tensor, ple: torch.Tensor | None = None):
    """The torch-ops FFN branch of `block`, added to x (a generator: an MoE asks for its experts), then the layer's
    end (`block_parts.finish`)."""
    a = model.args
    if not a.has_ffn(i):
        return x
    h = model.pre(x, w.ffn_norm, rms_norm)
    end = block_parts.Ending.of(w, a.experts_at(i)) if a.layer_end else None  # (Gemma 4)
    if model.ffn_inputs is not None:
        model.ffn_inputs.append((i, h))
    if w.flash is not None:
        raise CadenceError("--mode flash runs on cadence's CPU kernels; use --device cpu")
    if a.experts_beside_dense:  # Gemma 4's 26B
        x += yield from moe.beside_dense(model, i, w, x, h, rms_norm)
    elif a.experts_at(i):
        x += yield from moe.moe(model, i, w, h)
    else:
        model.residual(x, w.down, glu(model, w.gate_up(h)), w.ffn_post_norm, rms_norm)
    return x if end is None else block_parts.finish(model, x, end, ple, rms_norm)


def glu(model, gu: torch.Tensor) -> torch.Tensor:
    if model.args.act == "relu2":
        return torch.square(F.relu(gu))
    gate, up = gu.chunk(2, dim=-1)
    return (F.silu(gate) if model.args.act == "silu" else F.gelu(gate, approximate="tanh")) * up
