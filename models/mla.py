"""Multi-head latent attention (MLA: DeepSeek-V2's, Mistral 4's), as the block's queries, keys and values.

The queries come through a low-rank bottleneck with a norm between (`q = q_b(norm(q_a(x)))`, or one projection);
the keys and values from one latent per token: `kv_a(x)` gives the latent (normed) and a rotary key part shared by
every head, and `kv_b(latent)` each head's key part without rope and its value. Here each head's key is the shared
rotary part in the lanes the block's rotary tables turn (`lanes`: pairs (j, D/2 + j) for j < R/2) and its own part in
the others (the family reorders the queries' rows to match), so the attention after it is the block's own over a [T, q | k | v] projection; the KV cache holds
the expanded keys and values (not the latent: simpler, and more bytes a token)."""

from __future__ import annotations

from functools import cache

NORM_EPS = 1e-6  # the latents' norms take their own epsilon, not the model's (transformers' default)


@cache  # asked every layer of every forward: made once
def lanes(head_dim: int, rope_dim: int) -> tuple[list[int], list[int]]:
    """(the lanes of a head that rotate, in the order of the rotary part's halves; the lanes that do not)."""
    half, r = head_dim // 2, rope_dim // 2
    rot = [*range(r), *range(half, half + r)]
    return rot, [j for j in range(head_dim) if not (j < r or half <= j < half + r)]


def project(model, w, h, norm):
    """[T, q_dim + 2 kv_dim]: the queries, keys and values of the rows h [T, dim], as `w.qkv.matmul(h)` is elsewhere.
    (This module imports no torch: a family's reader takes `lanes` from here in processes that must not load it.)"""
    a = model.args
    T, H, D, R = h.shape[0], a.n_heads, a.head_dim, a.rope_dim
    q_in = h if w.mla_q_a is None else norm(w.mla_q_a.matmul(h), w.mla_q_a_norm, NORM_EPS)
    ckv = w.mla_kv_a.matmul(h)  # [T, rank + R]
    rank = ckv.shape[1] - R
    kv = w.mla_kv_b.matmul(norm(ckv[:, :rank], w.mla_kv_a_norm, NORM_EPS)).view(T, H, 2 * D - R)
    qkv = h.new_empty(T, 3 * H * D)
    qkv[:, : H * D] = w.mla_q.matmul(q_in)
    k = qkv[:, H * D : 2 * H * D].view(T, H, D)
    rot, nope = lanes(D, R)
    k[..., rot] = ckv[:, None, rank:]
    k[..., nope] = kv[..., : D - R]
    qkv[:, 2 * H * D :].view(T, H, D).copy_(kv[..., D - R :])
    return qkv
