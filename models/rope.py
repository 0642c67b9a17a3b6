"""Rotary embeddings: each layer kind's inverse frequencies, as the model's config derives them.

A config says how its frequencies are scaled (`RopeScaling`: Llama 3.1's wavelength bands, linear, YaRN,
Phi-3's LongRoPE, dynamic NTK, or per-frequency divisors as a GGUF's `rope_freqs` tensor gives them); these
functions compute them as transformers does (`modeling_rope_utils.py`), in the same float steps, so the cos/sin
tables match its own. A partial rotary (`rope_dim` < head_dim) gives zero frequencies past its half: those lanes
rotate by 0 (cos 1, sin 0), i.e. not at all, after the source has moved the rotated lanes into place
(models/families/base.py `permute_partial`).
"""

from __future__ import annotations

import math

import torch

from models.rope_scaling import RopeScaling


def inv_freq(
    head_dim: int, base: float, scaling: RopeScaling | None, rope_dim: int = 0, context: int = 0
) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim // 2], cos/sin factor) for a layer kind; `context`: the tokens a cache
    holds (LongRoPE takes its long factors, dynamic NTK its grown base, for a context past the pretraining one)."""
    dim = rope_dim or head_dim
    exps = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    factor, kind = 1.0, scaling.kind if scaling else "default"
    if kind == "dynamic" and context > scaling.original_context:
        f = scaling.factor
        base = base * ((f * context / scaling.original_context) - (f - 1)) ** (dim / (dim - 2))
    if kind in ("default", "linear", "dynamic", "llama3", "divisors"):
        inv = 1.0 / (base**exps)
        if kind == "linear":
            inv /= scaling.factor
        elif kind == "llama3":
            inv = _llama3(inv, scaling)
        elif kind == "divisors":
            inv = inv / torch.tensor(scaling.divisors[: len(inv)], dtype=torch.float32)
    elif kind == "proportional":  # the head's frequencies, the first pairs only (transformers' rounding)
        angles = int(scaling.proportion * head_dim // 2)
        inv = 1.0 / (base ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / head_dim)) / scaling.factor
    elif kind == "yarn":
        inv, factor = _yarn(base, dim, scaling)
    else:  # longrope
        ext = scaling.long_factor if context > scaling.original_context else scaling.short_factor
        inv = 1.0 / (torch.tensor(ext, dtype=torch.float32) * base**exps)
        factor = scaling.attention_factor or _longrope_factor(scaling)
    out = torch.zeros(head_dim // 2)
    out[: len(inv)] = inv
    return out, factor


def _llama3(inv: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    low_wavelen = s.original_context / s.low_freq_factor
    high_wavelen = s.original_context / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    llama = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (s.original_context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * llama / s.factor + smooth * llama
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, llama)


def _yarn(base: float, dim: int, s: RopeScaling) -> tuple[torch.Tensor, float]:
    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor = s.attention_factor or (
        float(mscale(s.factor, s.mscale) / mscale(s.factor, s.mscale_all_dim))
        if s.mscale and s.mscale_all_dim
        else mscale(s.factor)
    )

    def correction_dim(rotations):
        return (dim * math.log(s.original_context / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv = (1.0 / (s.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, factor


def _longrope_factor(s: RopeScaling) -> float:
    if s.factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(s.factor) / math.log(s.original_context))


class Rotary:
    """cos/sin tables [positions, head_dim] for rotate-half RoPE, grown on demand."""

    def __init__(self, inv: torch.Tensor, factor: float, device):
        self.inv_freq, self.factor = inv.to(device), factor
        self.cos = self.sin = torch.empty(0, 2 * inv.numel(), device=device)

    def ensure(self, need: int):
        if need > self.cos.shape[0]:
            n = max(need, 2 * self.cos.shape[0], 256)
            freqs = torch.outer(torch.arange(n, device=self.inv_freq.device).float(), self.inv_freq)
            emb = torch.cat([freqs, freqs], dim=-1)
            cos, sin = emb.cos(), emb.sin()
            if self.factor != 1.0:  # scales the rotated lanes only: a partial rotary's others pass as they are
                rotated = torch.cat([self.inv_freq, self.inv_freq]) != 0
                cos = torch.where(rotated, cos * self.factor, cos)
                sin = torch.where(rotated, sin * self.factor, sin)
            self.cos, self.sin = cos.contiguous(), sin.contiguous()

    def tables(self, positions: torch.Tensor):
        self.ensure(int(positions.max().item()) + 1)
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)  # [T, 1, D]
