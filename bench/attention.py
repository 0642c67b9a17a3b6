"""`launch bench --suite attention` (issue 7): one layer's tree-verification attention, four ways.

For verification widths 4..64 (a random tree of that many nodes, seeded) over contexts 256..2048,
on the target's attention shape (heads, KV heads, head size):
  (a) dense masked attention on one unit: torch SDPA over the full [rows, context + rows] mask
      (what an engine without tree kernels does), all cores; and our fused kernel (it skips masked
      pairs chunk by chunk), all cores;
  (b) the naive sparse part: the tree's ancestor pairs from the COO index of the mask, gathered,
      scored and softmax-reduced with torch scatter ops, one core;
  (c) our sparse kernel for the same part (csrc/attention.cpp, blocked over 32-key chunks,
      vectorized), one core, as the sparse-attention worker runs it;
  (d) the split ARCA prices, cut as the verifier actor cuts it: the verifier's dense chunks and
      the worker's last `share` of them plus the sparse part at the same time, one core each (two
      threads here), then the log-sum-exp merge; `+msg` adds the four control messages per layer the actor split costs
      (`RTT_S`, measured by `launch runtime-bench`).
Times are medians of repeated calls, in microseconds per layer.
"""

from __future__ import annotations

import random
import threading

import torch
import torch.nn.functional as F

from common.timing import median_time
from models import kernels
from models import split_attention
from models.attention import Visibility

WIDTHS = (4, 8, 16, 32, 64)
CONTEXTS = (256, 512, 1024, 2048)
SHARES = (0.0, 0.25, 0.5)


def _median_us(fn, reps: int = 7) -> float:
    return median_time(fn, reps) * 1e6


def random_tree(width: int, rng: random.Random) -> list[int]:
    """Parents of a tree of `width` nodes that leans deep, as draft trees do."""
    return [-1] + [
        rng.choice(range(max(0, i - 3), i)) if rng.random() < 0.8 else rng.randrange(-1, i) for i in range(1, width)
    ]


def naive_sparse(q, k_cache, v_cache, vis: Visibility, k0: int, scale: float):
    """The tree part from a COO list of (row, key) pairs with torch gather/scatter: softmax state per row."""
    T, H, D = q.shape
    rep = H // k_cache.shape[0]
    lens = (vis.ptr[1:] - vis.ptr[:-1]).long()
    rows = torch.repeat_interleave(torch.arange(T), lens)
    keys = vis.idx.long()
    if k0 < vis.n_shared:  # the shared tail past the last whole chunk
        tail = torch.arange(k0, vis.n_shared)
        rows = torch.cat([torch.arange(T).repeat_interleave(tail.numel()), rows])
        keys = torch.cat([tail.repeat(T), keys])
    k = k_cache[:, keys].repeat_interleave(rep, 0)  # [H, nnz, D]
    v = v_cache[:, keys].repeat_interleave(rep, 0)
    s = (q[rows].transpose(0, 1) * k).sum(-1) * scale  # [H, nnz]
    m = torch.full((H, T), float("-inf")).scatter_reduce(1, rows.expand(H, -1), s, "amax")
    p = torch.exp(s - m.gather(1, rows.expand(H, -1)))
    l = torch.zeros(H, T).index_add_(1, rows, p)
    o = torch.zeros(H, T, D).index_add_(1, rows, p.unsqueeze(-1) * v)
    return m, l, o


def _with_threads(n: int, fn):
    def run():
        old = torch.get_num_threads()
        torch.set_num_threads(n)
        try:
            return fn()
        finally:
            torch.set_num_threads(old)

    return run


def split_pass(q, kc, vc, vis: Visibility, c_star: int, share: float, scale: float):
    """The cut the verifier actor makes: it folds dense chunks [0, cut) on one core while the worker
    (a thread on the other core) computes the chunk states from key cut * CHUNK on (its share of the
    dense chunks, then the sparse part); then the merge, in chunk order."""
    cut = int(c_star * (1.0 - share))
    res = {}

    def worker():
        torch.set_num_threads(1)
        res["w"] = split_attention.attn_chunks(
            q, kc, vc, vis.n_shared, vis.ptr, vis.idx, cut * split_attention.CHUNK, scale
        )

    t = threading.Thread(target=worker)
    t.start()
    torch.set_num_threads(1)
    mine = split_attention.attn_dense(q, kc, vc, 0, cut, scale)
    t.join()
    return split_attention.attn_merge(mine, *res["w"])


def run(model_args, rtt_s: float, threads: int, seed: int = 0, progress=None) -> list[list[str]]:
    a = model_args
    H, Hkv, D = a.n_heads, a.n_kv_heads, a.head_dim
    scale = D**-0.5
    rng = random.Random(seed)
    table = [
        [
            "width",
            "context",
            "(a) SDPA dense mask",
            "(a) fused kernel",
            "(b) naive sparse",
            "(c) sparse kernel",
            *[f"(d) split {s}" for s in SHARES],
            "(d) best +msg",
            "max |split - fused|",
        ]
    ]
    torch.manual_seed(seed)
    for ctx in CONTEXTS:
        for width in WIDTHS:
            parents = random_tree(width, rng)
            vis = Visibility.tree(ctx, parents)
            n = ctx + width
            q = torch.randn(width, H, D)
            kc, vc = torch.randn(Hkv, n, D), torch.randn(Hkv, n, D)
            mask = vis.dense_mask(n)
            rep = H // Hkv
            kr, vr = kc.repeat_interleave(rep, 0), vc.repeat_interleave(rep, 0)
            c_star = ctx // split_attention.CHUNK
            all_cores = lambda fn: _with_threads(threads, fn)  # noqa: E731
            one = lambda fn: _with_threads(1, fn)  # noqa: E731
            sdpa = _median_us(
                all_cores(
                    lambda: F.scaled_dot_product_attention(q.transpose(0, 1), kr, vr, attn_mask=mask, scale=scale)
                )
            )
            fused = _median_us(all_cores(lambda: kernels.attention(q, kc, vc, vis.n_shared, vis.ptr, vis.idx, scale)))
            naive = _median_us(one(lambda: naive_sparse(q, kc, vc, vis, c_star * split_attention.CHUNK, scale)))
            sparse = _median_us(
                one(
                    lambda: split_attention.attn_chunks(
                        q, kc, vc, vis.n_shared, vis.ptr, vis.idx, c_star * split_attention.CHUNK, scale
                    )
                )
            )
            splits = [
                _median_us(_with_threads(threads, lambda s=s: split_pass(q, kc, vc, vis, c_star, s, scale)))
                for s in SHARES
            ]
            ref = kernels.attention(q, kc, vc, vis.n_shared, vis.ptr, vis.idx, scale)
            err = max(float((split_pass(q, kc, vc, vis, c_star, s, scale) - ref).abs().max()) for s in SHARES)
            table.append(
                [
                    str(width),
                    str(ctx),
                    *[f"{x:.0f}" for x in (sdpa, fused, naive, sparse, *splits)],
                    f"{min(splits) + 4 * rtt_s * 1e6:.0f}",
                    f"{err:.1e}",
                ]
            )
            if progress:
                progress()
    return table
