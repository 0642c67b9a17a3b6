"""A mixture of experts' FFN (qwen2_moe with a shared expert, qwen3_moe, olmoe, mixtral): each token routed to
`n_experts_used` of `n_experts` SwiGLU experts by a softmax over the router's logits, asked for as `NeedExperts` so
that they can be streamed (EdgeMoE's expert buffer), run in one kernel call where the kernels take them."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from models import expert_kernel, kernels
from models.attention import lanes
from models.block_parts import l2_norm
from models.requests import NeedExperts


def route(model, router, h: torch.Tensor, sel: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids [T, k], their weights [T, k]): softmax over the router's logits, top k, renormalised
    where the model does so. Each row on its own (the kernels' property): a token routes the same way
    verified in a tree or decoded alone."""
    a = model.args
    if a.router_sigmoid:  # sigmoid scores; `sel` (a bias) only chooses; the chosen renormalised and scaled
        s = lanes(torch.sigmoid, router.matmul(h))
        ids = torch.topk(s + sel if sel is not None else s, a.n_experts_used, dim=-1).indices
        top = s.gather(-1, ids)
        if a.norm_topk:
            top = top / (top.sum(-1, keepdim=True) + a.norm_topk_eps)
        return ids, top * a.routed_scale
    if a.router_topk_first:  # gpt-oss: the top k of the logits (the router's bias added), softmaxed among them
        top, ids = torch.topk(router(h), a.n_experts_used, dim=-1)
        return ids, torch.softmax(top, dim=-1)
    probs = torch.softmax(router.matmul(h), dim=-1)
    top, ids = torch.topk(probs, a.n_experts_used, dim=-1)
    if a.norm_topk:
        top = top / (top.sum(-1, keepdim=True) + a.norm_topk_eps)
    return ids, top if a.routed_scale == 1.0 else top * a.routed_scale  # scaled (Mistral 4)


def guess(model, i: int, h: torch.Tensor) -> tuple[int, ...]:
    """Next-router lookahead (mixtral-offloading): the experts layer i+1's router picks for layer i's FFN
    input, by their best routing weight over the rows; () at the last layer or when layer i+1 is not at hand."""
    try:
        nxt = model.weights.layer(i + 1)
    except (IndexError, KeyError):
        return ()
    if nxt.router is None:
        return ()
    ids, top = route(model, nxt.router, h, nxt.router_sel)
    best: dict[int, float] = {}
    for e, p in zip(ids.flatten().tolist(), top.flatten().tolist()):
        best[e] = max(best.get(e, 0.0), p)
    return tuple(sorted(best, key=lambda e: (-best[e], e)))  # the likeliest first: a preload takes the first few


def moe(model, i: int, w, h: torch.Tensor, r: torch.Tensor | None = None):
    """A generator: yields `NeedExperts` for the experts the rows of h route to, returns the layer's
    MoE output [T, dim] (each expert on its rows, weighted; plus the shared expert, gated). `r`: the router's input
    where it is not h (Gemma 4's)."""
    ids, top = route(model, w.router, h if r is None else r, w.router_sel)
    if w.expert_scale is not None:  # Gemma 4: each expert's weight times a scale of its own
        top = top * w.expert_scale[ids]
    if model.routes is not None:
        model.routes.append((ids, top, h))
    used = tuple(sorted(set(ids.flatten().tolist())))
    lookahead = guess(model, i, h) if model.lookahead else ()
    out = torch.zeros_like(h)
    if w.shexp_gate_up is not None:  # before the experts are asked for: a streamed layer's slot may be reused then
        shared = ffn(model, w.shexp_gate_up, w.shexp_down, h)
        out += shared if w.shexp_gate is None else torch.sigmoid(w.shexp_gate.matmul(h)) * shared
    n = model.expert_batch or len(used)  # a buffer that cannot hold the union at once takes it in parts
    for lo in range(0, len(used), n):
        part = used[lo : lo + n]
        experts = yield NeedExperts(i, part, lookahead)
        a = model.args
        tables = [experts[e].table for e in part] if model.fused and a.act == "silu" else [None]
        if all(t is not None for t in tables):  # one kernel call for the part (csrc/experts.cpp)
            biases = torch.stack([experts[e].biases for e in part]) if a.expert_bias else None
            oai = (a.swiglu_alpha, a.swiglu_limit) if a.swiglu_limit else None
            ids32 = torch.tensor(part, dtype=torch.int32)
            expert_kernel.experts(h, ids, top, ids32, torch.stack(tables), out, biases, oai, a.router_scales_input)
            continue
        for e in part:
            rows, k = (ids == e).nonzero(as_tuple=True)
            x, weight = h.index_select(0, rows), top[rows, k, None]
            if model.args.router_scales_input:  # Llama 4: the routing weight scales the expert's input
                out.index_add_(0, rows, ffn(model, experts[e].gate_up, experts[e].down, x * weight))
            else:
                out.index_add_(0, rows, ffn(model, experts[e].gate_up, experts[e].down, x) * weight)
    return out


def ffn(model, gate_up, down, h: torch.Tensor) -> torch.Tensor:
    a = model.args
    if a.swiglu_limit and model.fused:  # gpt-oss's activation as the expert kernel computes it
        return down(expert_kernel.oai_glu(gate_up(h), a.swiglu_alpha, a.swiglu_limit))
    if a.swiglu_limit:  # gpt-oss: biases, a clamped gate and up, (up + 1) * gate * sigmoid(alpha * gate)
        gate, up = gate_up(h).chunk(2, dim=-1)
        gate, up = gate.clamp(max=a.swiglu_limit), up.clamp(min=-a.swiglu_limit, max=a.swiglu_limit)
        return down((up + 1) * (gate * torch.sigmoid(gate * a.swiglu_alpha)))
    if model.fused:
        return down.matmul(kernels.glu(gate_up.matmul(h), a.act))
    gate, up = gate_up(h).chunk(2, dim=-1)
    return down((F.silu(gate) if a.act == "silu" else F.gelu(gate, approximate="tanh")) * up)


def beside_dense(model, i: int, w, x: torch.Tensor, h: torch.Tensor, norm):
    """Gemma 4's 26B FFN (a generator like `moe`): the dense MLP of h (x through the FFN's pre-norm) and the experts
    of x through a norm of their own, routed by x normed without a weight times the router's scale and dim^-1/2,
    each branch's output normed, their sum normed; returns what is added to x."""
    a = model.args
    dense = norm(ffn(model, w.gate_up, w.down, h), w.post_norm_1, a.norm_eps)
    r = l2_norm(x, a.norm_eps) * w.router_scale * a.dim**-0.5
    post_2, post = w.post_norm_2.clone(), w.ffn_post_norm.clone()  # (the layer's slot may be reused once experts run)
    experts = yield from moe(model, i, w, norm(x, w.norm_2, a.norm_eps), r)
    return norm(dense + norm(experts, post_2, a.norm_eps), post, a.norm_eps)
