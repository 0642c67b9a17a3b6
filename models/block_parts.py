"""Parts of the block a few families add, shared by its three paths (the CPU kernels' `Transformer.block_fused`,
models/torch_block.py and the batch's models/batch.py): queries scaled by their positions and Llama 4's L2 norms
(Ministral 3, Llama 4); per-layer embeddings and each layer's scalar on its output (Gemma 4)."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from models.attention import lanes


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama 4's weightless RMS norm over the last dimension (a head), each vector on its own."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def temper(model, q: torch.Tensor, positions: torch.Tensor, i: int, normed: bool = False) -> torch.Tensor:
    """Queries [T, H, D] of layer i scaled by their positions (Ministral 3, Llama 4's NoPE layers), in place;
    each row by its own position, so a tree node gets what it gets decoded alone. Llama 4's L2 norm first, unless
    they are `normed` (the CPU kernels' RoPE norms them: models/kernels.py `qkv_rope`)."""
    a = model.args
    if a.l2_at(i) and not normed:
        q.copy_(l2_norm(q, a.norm_eps))
    scales = query_scales(model, positions, i)
    if scales is not None:
        q *= scales.to(q.dtype).view(-1, 1, 1)
    return q


def query_scales(model, positions: torch.Tensor, i: int) -> torch.Tensor | None:
    """Layer i's factor on each row's queries (fp32 [T]: 1 + beta ln(1 + floor((pos + offset) / scale))), None where
    the layer's queries are not scaled by position. The one-call layer kernel takes it as `temper` applies it."""
    a = model.args
    if not a.attn_temp_beta or (a.attn_temp_layers and i not in a.attn_temp_layers):
        return None
    steps = torch.floor((positions.to(torch.float32).view(-1, 1) + a.attn_temp_offset) / a.attn_temp_scale)
    return lanes(lambda s: 1 + a.attn_temp_beta * torch.log1p(s), steps).view(-1).contiguous()


def ple_inputs(model, tokens: torch.Tensor, x: torch.Tensor, w0, norm) -> torch.Tensor | None:
    """The per-layer embeddings of a forward's rows [T, n_layers, ple_dim] (Gemma 4; None: the model has none): the
    table's rows of the tokens (read from disk: `weights.ple`) times sqrt(ple_dim), plus the normed projection of the
    embeddings x (by layer 0's `ple_proj`); their sum times 2^-1/2."""
    a, T = model.args, tokens.shape[0]
    if not a.ple_dim:
        return None
    rows = model.weights.ple[tokens].float().view(T, a.n_layers, a.ple_dim) * a.ple_dim**0.5
    proj = (w0.ple_proj.matmul(x) * a.dim**-0.5).view(T * a.n_layers, a.ple_dim)
    return (norm(proj, w0.ple_proj_norm, a.norm_eps).view(T, a.n_layers, a.ple_dim) + rows) * 2**-0.5


def with_ple(model, places: list, tokens: torch.Tensor, x: torch.Tensor, w0, norm) -> list:
    """Each layer's `Place` with its rows' per-layer embeddings (`ple_inputs`), where the model has them."""
    ple = ple_inputs(model, tokens, x, w0, norm)
    return places if ple is None else [p.with_ple(ple[:, i]) for i, p in enumerate(places)]


class Ending(NamedTuple):
    """What ends a layer (`finish`), taken before its FFN asks for experts: a streamed layer's slot may hold another
    group's bytes by the time they have run. A layer's scalar is copied there; per-layer embeddings' matrices beside
    experts are in no model (refused in models/args.py), so they are never held past that point."""

    gate: object = None
    out: object = None
    norm: torch.Tensor | None = None
    scale: torch.Tensor | None = None

    @staticmethod
    def of(w, experts: bool) -> "Ending":
        """Layer weights `w`'s ending; `experts`: the layer asks for experts, so its scalar is copied first."""
        scale = w.layer_scale.clone() if experts and w.layer_scale is not None else w.layer_scale
        return Ending(w.ple_gate, w.ple_out, w.ple_post_norm, scale)


def finish(model, x: torch.Tensor, end: Ending, ple: torch.Tensor | None, norm) -> torch.Tensor:
    """The end of a layer (Gemma 4), in place: its per-layer embedding's branch x += norm(W_out(gelu(W_gate x) *
    ple)), then x times the layer's scalar (`end`: the layer's `Ending`)."""
    if end.gate is not None:
        g = F.gelu(end.gate.matmul(x), approximate="tanh") * ple
        x += norm(end.out.matmul(g), end.norm, model.args.norm_eps)
    if end.scale is not None:
        x *= end.scale
    return x
