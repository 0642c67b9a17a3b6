"""Token choice: greedy, or temperature with nucleus (top-p) filtering from a seeded generator."""

from __future__ import annotations


import torch

from common.settings import SamplingConfig


def probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """The distribution tokens are drawn from: softmax(logits / T), restricted to the top-p nucleus.

    logits [..., V] -> probabilities [..., V] (fp32). Greedy is the one-hot of the argmax.
    """
    if cfg.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    p = torch.softmax(logits.float() / cfg.temperature, dim=-1)
    if cfg.top_p < 1.0:
        sp, order = p.sort(dim=-1, descending=True)
        keep = (sp.cumsum(-1) - sp) < cfg.top_p  # the smallest prefix whose mass reaches top_p
        sp = sp * keep
        p = torch.zeros_like(p).scatter(-1, order, sp)
        p = p / p.sum(-1, keepdim=True)
    return p


class Sampler:
    def __init__(self, cfg: SamplingConfig):
        self.cfg = cfg
        self.gen = torch.Generator().manual_seed(cfg.seed)

    def draw(self, p: torch.Tensor) -> int:
        """One token from distribution p [V]."""
        return int(torch.multinomial(p, 1, generator=self.gen).item())

    def uniform(self) -> float:
        return float(torch.rand((), generator=self.gen).item())

    def __call__(self, logits: torch.Tensor) -> int:
        """Next token from logits [V]."""
        if self.cfg.greedy:
            return int(logits.argmax().item())
        return self.draw(probs(logits, self.cfg))


class HeadArgmax:
    """Each row's most likely token over the output head's parts, one part's logits at a time: a greedy
    verification's answer without its [rows, vocabulary] logits (1.2 MB a row for a 152k vocabulary). The
    same token `argmax` gives over the whole row: the first of equal maxima, a NaN above every number."""

    def __init__(self, rows: int, device):
        self.best = torch.full((rows,), float("-inf"), device=device)
        self.ids = torch.zeros(rows, dtype=torch.long, device=device)

    def fold(self, logits: torch.Tensor, lo: int):
        """`logits` [rows, n]: the head's token rows [lo, lo + n)."""
        v, i = logits.max(-1)
        take = (v > self.best) | (v.isnan() & ~self.best.isnan())
        self.best = torch.where(take, v, self.best)
        self.ids = torch.where(take, i + lo, self.ids)
