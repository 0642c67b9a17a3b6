"""Which keys each new token sees, and attention over the KV cache.

A block of T new tokens is written to cache slots [L, L+T). Row r sees the committed slots
[0, n_shared) and then its own list of slots, in position order: for a causal block, the new
slots up to itself; for a token tree, the slots of its ancestors and itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from common.errors import CadenceError
from models import kernels


@dataclass(frozen=True)
class Visibility:
    n_shared: int
    ptr: torch.Tensor  # int32 [T + 1]
    idx: torch.Tensor  # int32 [nnz], absolute cache slots

    @property
    def rows(self) -> int:
        return self.ptr.numel() - 1

    @staticmethod
    def causal(cache_len: int, T: int) -> "Visibility":
        lens = torch.arange(1, T + 1, dtype=torch.int32)
        ptr = torch.zeros(T + 1, dtype=torch.int32)
        ptr[1:] = lens.cumsum(0)
        idx = torch.cat([torch.arange(cache_len, cache_len + r + 1, dtype=torch.int32) for r in range(T)])
        return Visibility(cache_len, ptr, idx)

    @staticmethod
    def tree(cache_len: int, parents: Sequence[int]) -> "Visibility":
        """parents[r] is the index of row r's parent in the block (-1: child of the committed context)."""
        rows: list[list[int]] = []
        for r, p in enumerate(parents):
            if p >= r:
                raise ValueError(f"tree nodes must come after their parents (node {r}, parent {p})")
            rows.append((rows[p] if p >= 0 else []) + [cache_len + r])
        ptr = torch.tensor([0] + [len(x) for x in rows], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        idx = torch.tensor([s for x in rows for s in x], dtype=torch.int32)
        return Visibility(cache_len, ptr, idx)

    @staticmethod
    def from_mask(mask: torch.Tensor) -> "Visibility":
        """mask [T, S] bool over cache slots 0..S-1 (a query sees slot s where mask is True)."""
        mask = mask.bool()
        full = mask.all(dim=0)
        n_shared = int(full.long().cumprod(0).sum().item())
        rows = [torch.nonzero(m[n_shared:]).flatten() + n_shared for m in mask]
        ptr = torch.tensor([0] + [len(x) for x in rows], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        idx = torch.cat(rows).to(torch.int32) if rows else torch.zeros(0, dtype=torch.int32)
        return Visibility(n_shared, ptr, idx)

    def dense_mask(self, n_slots: int) -> torch.Tensor:
        mask = torch.zeros(self.rows, n_slots, dtype=torch.bool)
        mask[:, : self.n_shared] = True
        for r in range(self.rows):
            mask[r, self.idx[self.ptr[r] : self.ptr[r + 1]].long()] = True
        return mask

    def depths(self) -> torch.Tensor:
        """Number of keys each row sees minus one: its position if the context starts at 0."""
        return (self.ptr[1:] - self.ptr[:-1]).long() + self.n_shared - 1


def store(cache: torch.Tensor, slot0: int, rows: torch.Tensor) -> None:
    """Keys or values rows [T, Hkv, D] (floats) into a layer's cache [Hkv, cap, ...] at slots slot0.., in the cache's
    dtype (--kv-dtype): rounded to nearest into halves, or quantized into q8_0 blocks by the kernels (as
    csrc/ops.cpp's fused write does, to the bit)."""
    T = rows.shape[0]
    if cache.dtype != torch.uint8:
        cache[:, slot0 : slot0 + T] = rows.transpose(0, 1)
        return
    _q8_kernels()
    for h in range(cache.shape[0]):
        kernels.q8_rows(rows[:, h].float().contiguous(), cache[h, slot0 : slot0 + T])


def floats(cache: torch.Tensor, d: int, n: int | None = None) -> torch.Tensor:
    """A layer's cache [Hkv, cap, ...] (its first n slots) as floats [Hkv, n, d], whatever its dtype."""
    part = cache[:, :n] if n is not None else cache
    if cache.dtype != torch.uint8:
        return part.float()
    _q8_kernels()
    return torch.stack([kernels.q8_floats(part[h].contiguous(), d) for h in range(part.shape[0])])


def _q8_kernels() -> None:
    """A q8 cache is written and read by the kernels only (its blocks: csrc/vec.hpp)."""
    if not kernels.available():
        raise CadenceError("--kv-dtype q8 runs on cadence's CPU kernels; use --kv-dtype f16 here")


def lanes(fn, x: torch.Tensor, group: int = 1) -> torch.Tensor:
    """fn of x [T, n] over rows padded with zeros to a multiple of 64 lanes (and of `group`, the width fn views a
    row's heads in): every element then goes through the same vectorised path, so a row is rounded the same in a
    forward of one row or of many (an elementwise op over a flat tensor takes its tail by another path)."""
    n = x.shape[1]
    return fn(padded(x, group))[:, :n]


def padded(x: torch.Tensor, group: int = 1) -> torch.Tensor:
    """x [T, n] with zero columns up to a multiple of 64 lanes and of `group` (x itself where it is one)."""
    T, n = x.shape
    width = -(-n // math.lcm(64, group)) * math.lcm(64, group)
    if width == n:
        return x
    pad = x.new_zeros(T, width)
    pad[:, :n] = x
    return pad


def chunk_vis(vis: Visibility, positions: torch.Tensor, chunk: int) -> Visibility:
    """A chunked-attention layer's visibility (Llama 4): row r sees what `vis` lets it see from its own chunk of
    `chunk` positions only (committed slot s holds position s; a row's own slots are its path, one position each,
    ending at its own)."""
    p = positions.to(torch.int64).cpu()
    lo = (p // chunk) * chunk
    ptr, idx = vis.ptr.tolist(), vis.idx.tolist()
    rows = []
    for r in range(vis.rows):
        own = idx[ptr[r] : ptr[r + 1]]
        keep = min(len(own), int(p[r] - lo[r]) + 1)
        rows.append(list(range(int(lo[r]), vis.n_shared)) + own[len(own) - keep :])
    new_ptr = torch.tensor([0] + [len(x) for x in rows], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    new_idx = torch.tensor([s for x in rows for s in x], dtype=torch.int32)
    return Visibility(0, new_ptr, new_idx)


def attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    vis: Visibility,
    scale: float,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, H, D] -> [T, H, D] over k/v cache [Hkv, cap, D]; `softcap` > 0: scores soft-capped (Gemma 2);
    `sinks` [H]: a logit per head in the softmax's denominator only (gpt-oss): the output times
    sum(e^s) / (sum(e^s) + e^sink) = sigmoid(lse - sink)."""
    if q.device.type == "cpu" and kernels.available():
        args = (q.contiguous(), k_cache, v_cache, vis.n_shared, vis.ptr, vis.idx, scale)
        return kernels.attention(*args, softcap=softcap, sinks=None if sinks is None else sinks.float().contiguous())
    # Elsewhere (CUDA, no compiler): torch's SDPA over a dense mask. Not batch-invariant.
    T, H, D = q.shape
    n = int(vis.idx.max().item()) + 1 if vis.idx.numel() else vis.n_shared
    n = max(n, vis.n_shared)
    mask = vis.dense_mask(n).to(q.device)
    rep = H // k_cache.shape[0]
    k = floats(k_cache, D, n).to(q.dtype).repeat_interleave(rep, 0)  # (a cache of halves or q8: read as floats)
    v = floats(v_cache, D, n).to(q.dtype).repeat_interleave(rep, 0)
    if softcap or sinks is not None:  # SDPA has neither a cap nor sinks: the scores by hand
        s = q.transpose(0, 1) @ k.transpose(1, 2) * scale
        s = (torch.tanh(s / softcap) * softcap if softcap else s).masked_fill(~mask, float("-inf"))
        if sinks is not None:
            s = torch.cat([s, sinks.view(-1, 1, 1).expand(-1, s.shape[1], 1)], dim=-1)
        p = torch.softmax(s, dim=-1)[..., : v.shape[1]]
        return (p @ v).transpose(0, 1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, scale=scale)
    return out.transpose(0, 1)
