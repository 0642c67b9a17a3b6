"""Expert-wise bitwidths (EdgeMoE §3.2): each expert stored at INT2, INT4 or INT8, chosen offline so
that the model's accuracy loss on calibration text stays within what the user tolerates.

Accuracy is measured against the model at INT8 (every expert): the share of calibration positions
where the mixed model's next-token choice (greedy, teacher-forced on the text) is the reference's.
EdgeMoE then (1) measures that loss with every expert at each bitwidth and takes as bounds the
lowest bitwidth whose loss is within the tolerance and the one below it; (2) ranks experts by
importance and lowers the K least important to the lower bound, searching the largest K whose
loss stays within the tolerance. EdgeMoE ranks experts by the accuracy lost when that one expert
alone goes to INT2 (one model evaluation per expert); here an expert's importance is what
quantizing it to the lower bound changes in its layer's output on the calibration tokens routed
to it (its routing weight times the output error, summed), measured in one pass, so that a model
of a thousand experts needs a dozen evaluations, not a thousand.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.heap import trim_heap
from models import linear, moe
from models.transformer import Transformer
from formats.weights import ExpertWeights

LEVELS = ("int2", "int4", "int8")  # from the fewest bits up


@dataclass
class BitwidthChoice:
    formats: dict[tuple[int, int], str]  # (layer, expert) -> format
    loss: float  # the chosen model's accuracy loss against INT8
    uniform_loss: dict[str, float]  # the loss with every expert at each level
    evaluations: int

    def bytes_saved(self, expert_bytes: dict[str, int]) -> float:
        """The share of expert bytes saved against INT4 everywhere, given one expert's bytes per format."""
        base = expert_bytes["int4"] * len(self.formats)
        return 1 - sum(expert_bytes[f] for f in self.formats.values()) / base if base else 0.0


class MixedExperts:
    """A weights provider over another one whose experts come at a chosen format each (`choice`)."""

    def __init__(self, base, variants: dict[str, dict[tuple[int, int], ExpertWeights]]):
        self.base, self.variants = base, variants
        self.head_groups = base.head_groups
        self.embed, self.ple = base.embed, base.ple
        self.choice: dict[tuple[int, int], str] = {}
        self.default = "int8"

    def layer(self, i):
        return self.base.layer(i)

    def head_part(self, j):
        return self.base.head_part(j)

    def experts(self, need):
        return {e: self.variants[self.choice.get((need.layer, e), self.default)][need.layer, e] for e in need.experts}


def quantize_experts(get, args, levels: tuple[str, ...] = LEVELS, group_size: int = 32, progress=None):
    """Every expert at every level: ({level: {(layer, expert): ExpertWeights}}, {(tensor name, level): (arrays,
    meta)} to write a store from without encoding again). `get(name)`: a canonical tensor as float, read one
    expert at a time (a model's experts in float would not fit in memory); `progress()`: called per expert."""
    variants: dict[str, dict] = {lvl: {} for lvl in levels}
    encoded: dict[tuple[str, str], tuple] = {}
    for i in range(args.n_layers):
        for e in range(args.n_experts):
            ws = {w: get(f"blk.{i}.exp.{e}.{w}") for w in ("gate_up", "down")}
            for lvl in levels:
                lin = {}
                for w, t in ws.items():
                    encoded[f"blk.{i}.exp.{e}.{w}", lvl] = arrays, meta = linear.encode(t, lvl, group_size)
                    lin[w] = linear.decode(lvl, arrays, meta)
                variants[lvl][i, e] = ExpertWeights(lin["gate_up"], lin["down"])
            if progress is not None:
                progress()
            if e % 16 == 15:  # the float copies came and went: give the heap they fragmented back
                trim_heap()
    return variants, encoded


def _logits(model: Transformer, ids: torch.Tensor) -> torch.Tensor:
    return model.forward(ids, torch.arange(len(ids)), model.new_cache(len(ids)))


def choose_bitwidths(
    model: Transformer,
    mixed: MixedExperts,
    calibration: list[torch.Tensor],
    tolerance: float,
    levels: tuple[str, ...] = LEVELS,
) -> BitwidthChoice:
    """`model` runs on `mixed` (variants for every one of `levels`, fewest bits first; the last is the
    reference the loss is measured against); `calibration`: token id sequences."""
    if not 0 <= tolerance < 1:
        raise ValueError(f"the tolerable accuracy loss is a share in [0, 1); got {tolerance}")
    a = model.args
    keys = [(i, e) for i in range(a.n_layers) for e in range(a.n_experts)]
    top = levels[-1]
    mixed.choice, mixed.default = {}, top
    # the reference's choices, and what each layer's experts saw (inputs, routing) on the calibration text
    model.routes, ref = [], []
    try:
        for ids in calibration:
            ref.append(_logits(model, ids).argmax(-1))
        routes = model.routes
    finally:
        model.routes = None
    evaluations = 0

    def loss(choice: dict, default: str) -> float:
        nonlocal evaluations
        evaluations += 1
        mixed.choice, mixed.default = choice, default
        same = total = 0
        for ids, r in zip(calibration, ref):
            got = _logits(model, ids).argmax(-1)
            same += int((got == r).sum())
            total += len(r)
        return 1 - same / total

    uniform = {lvl: (loss({}, lvl) if lvl != top else 0.0) for lvl in levels}
    hi = next(lvl for lvl in levels if uniform[lvl] <= tolerance)
    lo = levels[levels.index(hi) - 1] if hi != levels[0] else None
    if lo is None:  # even INT2 everywhere is within the tolerance
        return BitwidthChoice({k: hi for k in keys}, uniform[hi], uniform, evaluations)
    importance = _importance(model, mixed, routes, lo, top)
    order = sorted(keys, key=lambda k: importance.get(k, 0.0))  # least important first
    best, best_loss = 0, uniform[hi]
    lo_k, hi_k = 1, len(order)
    while lo_k <= hi_k:  # the largest K whose loss is within the tolerance (loss grows with K, nearly)
        k = (lo_k + hi_k) // 2
        got = loss({key: lo for key in order[:k]}, hi)
        if got <= tolerance:
            best, best_loss, lo_k = k, got, k + 1
        else:
            hi_k = k - 1
    formats = {key: hi for key in keys} | {key: lo for key in order[:best]}
    mixed.choice, mixed.default = {}, top
    return BitwidthChoice(formats, best_loss, uniform, evaluations)


def _importance(model: Transformer, mixed: MixedExperts, routes: list, lo: str, reference: str) -> dict:
    """(layer, expert) -> sum over the calibration tokens routed to it of ||routing weight x (E_lo(h) - E_ref(h))||^2,
    relative to the layer input's summed squares. `routes`: the reference pass's (ids, weights, h), layer after layer."""
    n = model.args.n_layers
    out: dict[tuple[int, int], float] = {}
    for j, (ids, top, h) in enumerate(routes):
        i, scale = j % n, float(h.pow(2).sum()) or 1.0
        for e in ids.unique().tolist():
            rows, k = (ids == e).nonzero(as_tuple=True)
            x = h.index_select(0, rows)
            ref, low = mixed.variants[reference][i, e], mixed.variants[lo][i, e]
            d = (moe.ffn(model, low.gate_up, low.down, x) - moe.ffn(model, ref.gate_up, ref.down, x)) * top[
                rows, k, None
            ]
            out[i, e] = out.get((i, e), 0.0) + float(d.pow(2).sum()) / scale
    return out
