"""int2 weights: an expert-only format (a mixture-of-experts store may keep each expert at its own
bitwidth, as EdgeMoE does), never a format a whole model is converted to (common.settings.FORMATS).

w ~ S sc q - M mn, as int4 (models/linear.py) with 2-bit codes: q 0..3 per weight, 8-bit sub-scale sc
and minimum mn per group of 32, fp16 S and M per super-block of 256 (the last may be short); stored in
int4's tiles (models/tiles.py), the codes four a byte. 2.625 bits a weight. Two bits leave four levels,
so a group's range is chosen by a small search (least squared error), not as its min and max, which
waste the outer levels on outliers.
"""

from __future__ import annotations

import torch

from common.errors import CadenceError
from common.settings import GROUP_SIZES

QG, SUPER = 32, 256  # group (sub-block), super-block
LEVELS = 3  # codes 0..3
# the search: fractions of a group's span cut from each end (a 7 x 7 grid of 0 .. 0.3 gave 0.2950 relative
# error on gaussian weights, this 3 x 3 one 0.2964, in a fifth of the time: a 7B mixture's experts in minutes)
SHRINK = (0.0, 0.1, 0.2)


def search_range(wg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group (last dim of wg): (scale >= 0, offset >= 0) with w ~ scale q - offset, q 0..3, of least
    squared error among candidate ranges (the min/max range with up to 30% of its span cut from either
    end), each refined by a least-squares fit of scale and offset to its codes."""
    lo = wg.amin(-1, keepdim=True).clamp(max=0)
    hi = wg.amax(-1, keepdim=True)
    span = hi - lo
    g = wg.shape[-1]
    best_err = torch.full_like(lo, float("inf"))
    best_s, best_b = span / LEVELS, lo.clone()
    for a in SHRINK:
        for c in SHRINK:
            l, h = lo + a * span, hi - c * span
            s = ((h - l) / LEVELS).clamp(min=1e-30)
            q = torch.round((wg - l) / s).clamp(0, LEVELS)
            # least squares of w ~ s q + b over the group, b (the minimum) kept <= 0
            sq, sw, sqq, sqw = q.sum(-1, True), wg.sum(-1, True), (q * q).sum(-1, True), (q * wg).sum(-1, True)
            det = g * sqq - sq * sq
            ok = det > 0
            s2 = torch.where(ok, (g * sqw - sq * sw) / torch.where(ok, det, 1.0), s).clamp(min=0)
            b2 = torch.where(ok, (sw - s2 * sq) / g, l).clamp(max=0)
            q2 = torch.round((wg - b2) / s2.clamp(min=1e-30)).clamp(0, LEVELS)
            err = ((s2 * q2 + b2 - wg) ** 2).sum(-1, True)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_s, best_b = torch.where(better, s2, best_s), torch.where(better, b2, best_b)
    return best_s.squeeze(-1), (-best_b).squeeze(-1)


def two_level(t: torch.Tensor, n: int, ng: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int4's and int2's scales: [N, K/32] non-negative values -> (8-bit multiples uint8 [N, K/32], fp16 super
    values [N, K/256] (max / 255, the last super-block may be short), the values they represent as float)."""
    nsb = -(-ng // (SUPER // QG))
    pad = nsb * (SUPER // QG) - ng
    sup = (torch.nn.functional.pad(t, (0, pad)).view(n, nsb, SUPER // QG).amax(-1) / 255.0).half()
    sup_g = sup.float().repeat_interleave(SUPER // QG, dim=1)[:, :ng]
    q8 = torch.where(sup_g > 0, torch.round(t / sup_g.clamp(min=1e-30)), torch.zeros_like(t)).clamp(0, 255)
    return q8.to(torch.uint8).contiguous(), sup.contiguous(), sup_g * q8


def check_group(fmt: str, group: int, k: int) -> None:
    """One sentence where a quantized format's group size is not one it has, or does not divide the input width."""
    if group not in GROUP_SIZES:
        raise CadenceError(f"{fmt} group size {group} is not supported; use 32 or 64")
    if k % group:
        raise CadenceError(
            f"{fmt} with groups of {group} needs the input width ({k}) to be a multiple of {group}; try --group-size 32"
        )


def quantize_int2(w: torch.Tensor, group: int) -> tuple[dict[str, torch.Tensor], dict]:
    """w [N, K] float -> the int2 arrays (layout above) and metadata."""
    n, k = w.shape
    check_group("int2", group, k)
    ng = k // QG
    scale, offset = search_range(w.float().view(n, k // group, group))
    scale, offset = scale.repeat_interleave(group // QG, dim=1), offset.repeat_interleave(group // QG, dim=1)
    sc, s16, scale_q = two_level(scale, n, ng)
    mn, m16, offset_q = two_level(offset, n, ng)
    wq = w.float().view(n, ng, QG)
    codes = (
        torch.where(
            scale_q[..., None] > 0,
            torch.round((wq + offset_q[..., None]) / scale_q[..., None].clamp(min=1e-30)),
            torch.zeros_like(wq),
        )
        .clamp(0, LEVELS)
        .to(torch.uint8)
    )
    return {"q": codes.view(n, k), "sc": sc, "mn": mn, "s": s16, "m": m16}, {"group": group}  # per row
