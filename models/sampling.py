"""Token choice: each row's logits, with that row's own recent text and position, to one token.

Penalties first (llama.cpp's: over the text's last `repeat_last_n` tokens, a token's logit divided by the
repetition penalty, or multiplied where negative, then lowered by the presence penalty and by the frequency
penalty times its count), then greedy's argmax, or a draw from softmax(logits / temperature) kept to its top_k,
top_p nucleus and min_p. The draw is the Gumbel-max of the kept log-probabilities under noise that depends on
the seed and the token's position alone (`noise`): exact sampling, since each position's noise is independent of
the text before it, and the same token wherever that row is computed. A tree's node is accepted where its token is
the target's choice for its parent's row, as under greedy, so speculation is token for token the target alone with
the same seed, in a tree, a chain or a batch; the draft ranks its candidates by the same scores.
"""

from __future__ import annotations

from typing import Sequence

import torch

from common.settings import SamplingConfig

GOLDEN, MIX1, MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # splitmix64's constants
NUCLEUS_BINS = 16 * 64  # top_p's bins of log-probability, 1/16 nat each (the last holds everything below -64)
CANDIDATES = 64  # a draft's scores: its likeliest this many tokens only (a guess needs no more)


def _signed(x: int) -> int:
    """A 64-bit pattern as the int64 that holds it (torch's integers are signed; their products wrap)."""
    x &= 2**64 - 1
    return x - 2**64 if x >= 2**63 else x


def _key(seed: int, position: int) -> int:
    """One 64-bit key for (seed, position), splitmix64 over each."""
    h = 0
    for x in (seed, position):
        h = (h ^ (x & (2**64 - 1))) * MIX1 & (2**64 - 1)
        h = (h ^ (h >> 31)) * MIX2 & (2**64 - 1)
        h ^= h >> 29
    return h


def _shr(h: torch.Tensor, k: int) -> torch.Tensor:
    """A logical right shift of int64 bit patterns."""
    return (h >> k) & ((1 << (64 - k)) - 1)


def noise(seed: int, position: int, ids: torch.Tensor | int) -> torch.Tensor:
    """Gumbel noise (fp64) for the token `ids` (a tensor of them, or n: ids 0..n-1) at `position` of the whole text
    under `seed`: a counter-based hash of (seed, position, id) (splitmix64), so a token's value is the same in
    any row, any process, any width of head, and a draft can take its few candidates' alone. Its uniforms are
    53-bit, strictly inside (0, 1): the noise lies within [-3.7, 37.5], and a token more than 41 nats below the
    likeliest (under 1e-12 of the mass, all such tokens together) is never drawn."""
    ids = torch.arange(ids, dtype=torch.int64) if isinstance(ids, int) else ids.to(torch.int64)
    h = ids * _signed(GOLDEN) + _signed(_key(seed, position))
    h ^= _shr(h, 30)
    h *= _signed(MIX1)
    h ^= _shr(h, 27)
    h *= _signed(MIX2)
    h ^= _shr(h, 31)
    u = (_shr(h, 11).double() + 0.5) * 2.0**-53
    return u.log_().neg_().log_().neg_()


def penalize(logits: torch.Tensor, cfg: SamplingConfig, text: Sequence[int]) -> torch.Tensor:
    """`logits` [V] with the penalties for the last `repeat_last_n` tokens of `text` (a new tensor where any apply).
    Token ids past the row's width (a draft's cut head) are not in it."""
    if not cfg.penalized:
        return logits
    window = text if cfg.repeat_last_n < 0 else text[len(text) - min(len(text), cfg.repeat_last_n) :]
    ids, counts = torch.tensor(list(window), dtype=torch.long).unique(return_counts=True)
    keep = ids < logits.shape[-1]
    ids, counts = ids[keep].to(logits.device), counts[keep].to(logits.device, logits.dtype)
    out = logits.clone()
    v = out[ids]
    if cfg.repetition_penalty != 1:
        v = torch.where(v > 0, v / cfg.repetition_penalty, v * cfg.repetition_penalty)
    out[ids] = v - counts * cfg.frequency_penalty - cfg.presence_penalty
    return out


def kept_logprobs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """log softmax(logits / T) [V] (fp64), -inf outside top_k, the top_p nucleus and min_p (not renormalized: a
    Gumbel-max draws in proportion all the same)."""
    lp = torch.log_softmax(logits.double() / cfg.temperature, -1)
    if 0 < cfg.top_k < lp.shape[-1]:
        kth = torch.topk(lp, cfg.top_k).values[-1]
        lp = lp.masked_fill(lp < kth, float("-inf"))
        lp = lp - torch.logsumexp(lp, -1)
    if cfg.top_p < 1:
        lp = _nucleus(lp, cfg.top_p)
    if cfg.min_p > 0:
        lp = lp.masked_fill(lp < lp.max() + torch.log(torch.tensor(cfg.min_p, dtype=lp.dtype)), float("-inf"))
    return lp


def _nucleus(lp: torch.Tensor, top_p: float) -> torch.Tensor:
    """The smallest set of likeliest tokens whose mass reaches top_p (ties at its edge kept), in one pass: the mass
    in bins of 1/16 nat says which bin the edge falls in (the bins before it are inside, those after outside), and
    only that bin's tokens are sorted."""
    p = lp.exp()
    bins = (-lp * 16).clamp(max=NUCLEUS_BINS - 1).long()
    cum = torch.bincount(bins, weights=p, minlength=NUCLEUS_BINS).cumsum(0)
    k = min(int((cum < top_p).sum()), NUCLEUS_BINS - 1)  # the bin where the mass reaches top_p
    before = float(cum[k - 1]) if k else 0.0
    sp = p[bins == k].sort(descending=True).values
    edge = sp[max(int((before + sp.cumsum(0) - sp < top_p).sum()), 1) - 1]
    return lp.masked_fill(p < edge, float("-inf"))


def scores(
    logits: torch.Tensor, cfg: SamplingConfig, text: Sequence[int], candidates: int = 0, allowed=None
) -> torch.Tensor:
    """What the token after `text` is the argmax of: the penalized logits under greedy, else the kept
    log-probabilities plus the noise of position len(text). `candidates`: only the likeliest this many get their
    noise, the rest -inf (a draft's guess at the target's choice, not the choice itself). `allowed`: a bool mask of
    the tokens a grammar allows there (speculative/grammar.py), the others -inf before anything else."""
    x = penalize(logits.float(), cfg, text)
    if allowed is not None:
        x = x.masked_fill(~allowed[: x.shape[-1]].to(x.device), float("-inf"))
    if cfg.greedy:
        return x
    if 0 < candidates < x.shape[-1]:  # log-probabilities among the candidates: the full row's less a constant
        v, ids = torch.topk(x, candidates)
        out = torch.full(x.shape, float("-inf"), dtype=torch.float64, device=x.device)
        out[ids] = kept_logprobs(v, cfg) + noise(cfg.seed, len(text), ids.cpu()).to(x.device)
        return out
    return kept_logprobs(x, cfg) + noise(cfg.seed, len(text), x.shape[-1]).to(x.device)


def choose(logits: torch.Tensor, cfg: SamplingConfig, text: Sequence[int], allowed=None) -> int:
    """The token after `text` (every token so far, prompt included) from its row's logits [V], among the tokens
    `allowed` (a grammar's mask; None: all)."""
    if cfg.plain:
        return int(logits.argmax())
    return int(scores(logits, cfg, text, allowed=allowed).argmax())


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> list:
    """[token, its log-probability, [[id, log-probability] of the `top` likeliest]] under the model's own distribution
    (the logits' softmax: before the penalties, the temperature and the cuts, as OpenAI's and vLLM's logprobs are)."""
    lp = torch.log_softmax(logits.float(), -1)
    best = torch.topk(lp, top) if top > 0 else None
    alts = [[int(i), float(v)] for v, i in zip(best.values, best.indices)] if best is not None else []
    return [int(token), float(lp[token]), alts]


class HeadArgmax:
    """Each row's most likely token over the output head's parts, one part's logits at a time: a greedy
    verification's answer without its [rows, vocabulary] logits (1.2 MB a row for a 152k vocabulary). The
    same token `argmax` gives over the whole row: the first of equal maxima, a NaN above every number."""

    def __init__(self, rows: int, device, kernel: bool = False, div: float = 1.0):
        """`kernel`: resident parts of quantized rows may be folded in one kernel call (`hold`): their logits are
        the head's own divided by `div` (Granite's logit scale; no cap after the product) and on the CPU."""
        self.best = torch.full((rows,), float("-inf"), device=device)
        self.ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.kernel, self.div, self.held = kernel, div, []

    def hold(self, part, resident: bool, h: torch.Tensor) -> bool:
        """Keep a resident part of the head (a `formats.weights.HeadPart` of quantized rows) to fold with the others
        in one kernel call (`flush`). False where it is to be folded as its logits come (a streamed part, whose slot
        is reused after it, and rows the kernel cannot take): the parts kept before it are folded first, in order
        (`h`: the rows' normed input to the head)."""
        rec = part.fold_record() if resident and self.kernel else None
        if rec is None:
            self.flush(h)
            return False
        self.held.append(rec)
        return True

    def flush(self, h: torch.Tensor) -> torch.Tensor:
        """Fold the parts `hold` kept, in one call; the rows' tokens so far."""
        if self.held:
            from models import kernels

            kernels.head_argmax(self.held, h.contiguous(), self.best, self.ids, self.div)
            self.held = []
        return self.ids

    def fold(self, logits: torch.Tensor, lo: int):
        """`logits` [rows, n]: the head's token rows [lo, lo + n)."""
        v, i = logits.max(-1)
        take = (v > self.best) | (v.isnan() & ~self.best.isnan())
        self.best = torch.where(take, v, self.best)
        self.ids = torch.where(take, i + lo, self.ids)
