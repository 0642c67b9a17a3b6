"""The attention split between the verifier and the sparse worker (actors/executor.py), in the CPU kernels
(csrc/attention.cpp): the verifier's running states over the shared prefix's dense chunks, the worker's chunk states
from a key index on, and their merge in order into the attention's output: the bits of the attention in one call
(`kernels.attention`), whatever the split."""

from __future__ import annotations

import torch

from models.kernels import address, kv_kind, lib

CHUNK = 32  # keys per chunk of the canonical attention (csrc/attention.cpp: CH)


def attn_dense(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    c0: int,
    c1: int,
    scale: float,
    state: tuple | None = None,
) -> tuple:
    """Running states (m [T, H], l [T, H], o [T, H, D]) over shared-prefix chunks [c0, c1)."""
    T, H, D = q.shape
    Hkv, cap, _ = k_cache.shape
    if state is None:
        state = (torch.full((T, H), float("-inf")), torch.zeros(T, H), torch.zeros(T, H, D))
    m, l, o = state
    tensors = map(address, (q.contiguous(), k_cache, v_cache, m, l, o))
    lib().cad_attn_dense(*tensors, T, H, Hkv, D, cap, c0, c1, scale, kv_kind(k_cache), torch.get_num_threads())
    return state


def max_chunks(n_shared: int, ptr: torch.Tensor, k0: int) -> int:
    """How many chunk states a row can have from key index k0 on."""
    longest = int((ptr[1:] - ptr[:-1]).max()) if ptr.numel() > 1 else 0
    return max(1, -(-(max(n_shared - k0, 0) + longest) // CHUNK))


def attn_chunks(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    n_shared: int,
    ptr: torch.Tensor,
    idx: torch.Tensor,
    k0: int,
    scale: float,
    maxc: int | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's chunk states from key index k0 on: ([T, H, maxc, D + 2], counts [T]); `out`: where to write them."""
    T, H, D = q.shape
    Hkv, cap, _ = k_cache.shape
    maxc = maxc or max_chunks(n_shared, ptr, k0)
    ch = (
        torch.empty(T, H, maxc, D + 2)
        if out is None
        else out.view(torch.float32)[: T * H * maxc * (D + 2)].view(T, H, maxc, D + 2)
    )
    nch = torch.zeros(T, dtype=torch.int32)
    lib().cad_attn_chunks(
        address(q.contiguous()),
        address(k_cache),
        address(v_cache),
        address(ch),
        address(nch),
        T,
        H,
        Hkv,
        D,
        cap,
        n_shared,
        address(ptr),
        address(idx),
        k0,
        maxc,
        scale,
        kv_kind(k_cache),
        torch.get_num_threads(),
    )
    return ch, nch


def attn_merge(state: tuple, ch: torch.Tensor, nch: torch.Tensor) -> torch.Tensor:
    """Fold chunk states into the running states in order and normalise: the attention output [T, H, D]."""
    m, l, o = state
    T, H, D = o.shape
    out = torch.empty(T, H, D)
    lib().cad_attn_merge(
        address(m), address(l), address(o), address(ch.contiguous()), address(nch), address(out), T, H, D, ch.shape[2]
    )
    return out
