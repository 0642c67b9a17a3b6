"""A short-convolution layer (LFM2) over a token tree: the taps of a node are its own input row and its nearest
ancestors', so siblings never see each other and a tree verifies in one forward, as a chain does.

in_proj(x) -> [B | C | x~]; each token's row B * x~ goes to the cache (models/kvcache.py: like a key, compacted
by `commit(keep)`); out = out_proj(C * sum_j w[:, K-1-j] * row(ancestor j)), ancestor 0 the node itself. A node's
ancestors are the last slots its visibility lists (position order), then the committed slots before them; a
context shorter than the kernel pads with zeros, as transformers' causal conv1d does.
"""

from __future__ import annotations

import torch

from models.attention import Visibility


def taps(vis: Visibility, kernel: int) -> torch.Tensor:
    """int64 [T, kernel]: the cache slot of each row's j-th nearest ancestor (j = 0: the row itself), -1 past the
    start of the context."""
    ptr, idx = vis.ptr.long(), vis.idx.long()
    count = ptr[1:] - ptr[:-1]  # each row's own slots (ancestors in this forward or pending, itself last)
    j = torch.arange(kernel).view(1, -1)
    own = j < count.view(-1, 1)
    at = (ptr[1:].view(-1, 1) - 1 - j).clamp(min=0, max=max(idx.numel() - 1, 0))
    from_idx = idx[at] if idx.numel() else torch.zeros_like(at)
    committed = vis.n_shared - 1 - (j - count.view(-1, 1))
    return torch.where(own, from_idx, committed).clamp(min=-1)


def conv_mix(rows: torch.Tensor, slot0: int, bx: torch.Tensor, weight: torch.Tensor, vis: Visibility) -> torch.Tensor:
    """bx [T, dim] (B * x~ of the new rows) into `rows` [capacity, dim] at slot0, then each row's convolution over
    its taps: [T, dim]. `weight` [dim, kernel] as transformers' Conv1d holds it (tap kernel-1 on the row itself)."""
    T, kernel = bx.shape[0], weight.shape[1]
    rows[slot0 : slot0 + T] = bx
    slots = taps(vis, kernel).to(rows.device)  # [T, K]
    got = rows[slots.clamp(min=0)] * (slots >= 0).unsqueeze(-1).to(rows.dtype)  # [T, K, dim]
    out = got[:, 0] * weight[:, kernel - 1]
    for j in range(1, kernel):  # tap by tap: each row's sum in the same order whatever the forward's rows
        out += got[:, j] * weight[:, kernel - 1 - j]
    return out
