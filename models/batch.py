"""One forward over several generations at once (issue 42: Lookahead's batch inference, a streamed layer read once
for every generation in the batch).

Each generation brings its own rows (a prompt chunk, a token, or a tree with its root), positions, KV cache and
visibility. The linear layers, the norms and the output head run over every generation's rows together; the
attention runs per generation, over its own cache with its own mask. The CPU kernels compute each row in an
order that depends on that row alone, so a row gets the same bits in a batch as in a forward of its own: every
generation's tokens are the ones it would get alone (tests/models/test_batch.py).

Like `Transformer.forward_steps`, `forward_many_steps` is a generator of weight requests: a layer is asked for
once, whatever the number of generations, and a streaming verifier feeds it from the loader.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from common.errors import CadenceError
from models import block_parts, kernels, layer_kernel
from models.attention import Visibility, attend
from models.transformer import Transformer


class Rows(NamedTuple):
    """One generation's part of a batched forward."""

    tokens: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    cache: object  # its KVCache
    vis: Visibility | None = None  # default: causal over its whole cache
    last: bool = False  # only its last row's output is wanted (a prompt's chunk): only that row meets the head


def forward_many_steps(model: Transformer, batch: list[Rows], argmax: bool = False):
    """`model.forward_steps` over several generations' rows: returns each one's logits (or, with `argmax`, its rows'
    most likely tokens), in the batch's order. Dense blocks on the CPU kernels (a mixture of experts, LLM in a
    flash and the split worker each run one generation at a time)."""
    a = model.args
    if a.moe or not model.fused:
        raise CadenceError(f"a batch of generations runs dense blocks on the CPU kernels; {a.arch} here does not")
    spans, places, positions, at = [], [], [], 0
    for r in batch:
        r.cache.reserve(r.positions)
        vis = r.vis or Visibility.causal(r.cache.end, r.tokens.shape[0])
        places.append(model.places(r.cache, vis, r.positions))
        positions.append(r.positions.to(torch.int64).contiguous())
        spans.append((at, at + r.tokens.shape[0]))
        at += r.tokens.shape[0]
    x = model.weights.embed[torch.cat([r.tokens for r in batch])].float()
    if a.embed_scale != 1.0:
        x = x * a.embed_scale
    pos, tokens = torch.cat(positions), torch.cat([r.tokens for r in batch])
    ple = None
    for i, need in enumerate(model.layer_needs):
        w = yield need
        if i == 0 and a.ple_dim:  # per-layer embeddings over every generation's rows (Gemma 4)
            ple = block_parts.ple_inputs(model, tokens, x, w, kernels.rmsnorm)
        if w.flash is not None:
            raise CadenceError("a batch of generations does not run LLM in a flash's sparse FFN")
        rec = layer_kernel.record(w, a, i) if model.layer_calls and model.ffn_inputs is None else None
        if rec is not None:  # the whole layer in one call over every generation's rows, the same bits
            scales = block_parts.query_scales(model, pos, i) if a.attn_temp_beta else None
            layer_kernel.run_many(rec, x, pos, [p[i] for p in places], spans, model.scale, a.norm_eps, scales)
        else:
            block(model, i, w, x, positions, [p[i] for p in places], spans, None if ple is None else ple[:, i])
    for r in batch:
        r.cache.pending += r.tokens.shape[0]
    if any(r.last for r in batch):  # a prompt's rows but its last go no further
        keep = [(hi - 1, hi) if r.last else (lo, hi) for r, (lo, hi) in zip(batch, spans)]
        x = torch.cat([x[lo:hi] for lo, hi in keep])
        spans, at = [], 0
        for lo, hi in keep:
            spans.append((at, at + hi - lo))
            at += hi - lo
    out = yield from model.head_steps(x, argmax)
    return [out[lo:hi] for lo, hi in spans]


def block(model: Transformer, i: int, w, x: torch.Tensor, positions: list, places: list, spans: list, ple=None):
    """One layer over every generation's rows, in place in `x`, where the one-call kernel does not take the layer:
    the separate kernel calls of `Transformer.block_fused`, each generation's attention its own."""
    a = model.args
    h = None  # the layer's normed input, where two mixers share it (Falcon-H1): normed once, before either adds
    if a.parallel_mixers and a.recurrent(i):
        h = model.pre(x, w.attn_norm, kernels.rmsnorm)
        h = x.clone() if h is x else h
    if a.recurrent(i):  # each generation's rows over its own state
        for (lo, hi), at in zip(spans, places):
            model.mixer(x[lo:hi], w, at if at.rec is None else at.rec, kernels.rmsnorm, None if h is None else h[lo:hi])
    if a.attends(i):
        h = model.pre(x, w.attn_norm, kernels.rmsnorm) if h is None else h
        qkv, bias = model.project(w, h, kernels.rmsnorm, i)
        o = torch.empty(x.shape[0], a.q_dim_at(i), dtype=x.dtype)
        for (lo, hi), pos, at in zip(spans, positions, places):
            q = model.rotate(qkv[lo:hi], bias, pos, at, i)
            if a.tempered:  # (Llama 4's L2 norms: by `rotate`)
                block_parts.temper(model, q, pos, i, normed=True)
            o[lo:hi] = attend(q, at.k, at.v, at.vis, model.scale, a.attn_softcap, w.attn_sinks).reshape(hi - lo, -1)
        model.residual(x, w.attn_out, model.gated(o, w, h), w.attn_post_norm, kernels.rmsnorm)
    if w.gate_up is None:  # a mixer-only layer (Nemotron-H)
        return
    h = model.pre(x, w.ffn_norm, kernels.rmsnorm)
    model.residual(x, w.down, model.act(w.gate_up.matmul(h)), w.ffn_post_norm, kernels.rmsnorm)
    if a.layer_end:
        block_parts.finish(model, x, block_parts.Ending.of(w, False), ple, kernels.rmsnorm)
