"""Making the activation predictors (flash/predictor.py) and measuring their recall on the model's own
activations.

For each prompt the dense model continues greedily (the text it meets when it generates); every layer's FFN
input h is recorded on the way, the prompt's tokens and the continuation's. The kernels give a row the same
result alone or in a block, so these are the inputs a teacher-forced pass over prompt and continuation would
see. Recall is measured against each held-out token's true top `density` of neurons.

Low rank: per layer, W2 W1 is the rank-r map closest to the layer's own [gate; up] weights W (int4,
dequantized) on the calibration inputs: it minimises E ||W h - W2 W1 h||^2, which with C = E[h h^T] = L L^T is
the truncated SVD of W L (Eckart-Young in C's metric). Closed form, seconds a layer; on the 1.5B it ranks
neurons better than a linear scorer of the same size trained with BCE and Adam against top-k labels (the
paper's recipe for ReLU models), which cannot express |up . h|.

int2: W itself rounded to 2-bit codes (models/linear_int2.py: each group's range searched for least squared
error); no calibration inputs, seconds a layer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from common.errors import CadenceError
from models import linear
from flash.footprint import INT2, KINDS, top_k
from flash.predictor import Int2Predictor, LowRankPredictor, Predictor, activations, recall_at_k
from models.transformer import Transformer


@dataclass(frozen=True)
class FitConfig:
    kind: str = "lowrank"  # or int2 (KINDS)
    rank: int | None = None  # a low-rank predictor's (None: 128)
    density: float = 0.3  # the share of neurons recall is measured at
    tokens: int = 64  # generated per prompt

    def __post_init__(self):
        if self.kind not in KINDS:
            raise CadenceError(f"--kind {self.kind}: a predictor is one of {', '.join(KINDS)}")
        if self.kind == INT2 and self.rank is not None:
            raise CadenceError(f"--rank {self.rank} is for --kind lowrank; an int2 predictor has no rank")
        if (self.rank is not None and self.rank < 1) or not 0 < self.density <= 1 or self.tokens < 0:
            raise CadenceError(
                f"--rank {self.rank}, --density {self.density}, --tokens {self.tokens}: "
                "give a rank of 1 or more, a density in (0, 1] and 0 or more tokens"
            )


def capture(model: Transformer, prompts: Sequence[Sequence[int]], n_new: int) -> list[torch.Tensor]:
    """Each layer's FFN inputs [N, dim] over the prompts' tokens and their greedy continuations of `n_new`."""
    per_layer: list[list[torch.Tensor]] = [[] for _ in range(model.args.n_layers)]
    model.ffn_inputs = []
    try:
        for ids in prompts:
            cache = model.new_cache(len(ids) + n_new)
            tokens = torch.tensor(list(ids))
            for step in range(n_new + 1):
                last = step == n_new  # the last token is recorded but needs no next one
                positions = torch.arange(cache.end, cache.end + len(tokens))
                logits = model.forward(tokens, positions, cache, logits_rows=slice(-1, None))
                cache.commit()
                for i, h in model.ffn_inputs:
                    per_layer[i].append(h.clone())
                model.ffn_inputs.clear()
                if last or cache.end >= cache.capacity:
                    break
                tokens = logits[-1:].argmax(-1)
    finally:
        model.ffn_inputs = None
    return [torch.cat(hs) for hs in per_layer]


def fit_layer(w: torch.Tensor, h: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """W1 [rank, dim], W2 [2F, rank]: the rank-r map closest to w [2F, dim] on the inputs h [N, dim]."""
    c = (h.T.double() @ h.double()) / max(h.shape[0], 1)
    lam, q = torch.linalg.eigh(c)
    lam = lam.clamp_min(lam.max().clamp_min(1e-30) * 1e-6)  # fewer tokens than dims: C is singular
    m = w.double() @ (q * lam.sqrt())  # W L, with C = L L^T
    _, v = torch.linalg.eigh(m.T @ m)  # right singular vectors of W L, ascending
    v = v[:, -rank:].flip(-1)
    return (v.T @ (q / lam.sqrt()).T).float(), (m @ v).float()  # V^T L^-1, W L V


def fit(
    model: Transformer,
    calibration: Sequence[Sequence[int]],
    heldout: Sequence[Sequence[int]],
    cfg: FitConfig,
    say: Callable[[str], None] = lambda s: None,
) -> Predictor:
    """A predictor of `cfg.kind` for every layer of `model` (a dense SwiGLU transformer, every layer at hand),
    its recall measured on the `heldout` prompts' tokens and continuations."""
    a = model.args
    t0 = time.time()
    h_ho = capture(model, heldout, cfg.tokens)
    h_cal = capture(model, calibration, cfg.tokens) if cfg.kind != INT2 else []
    cal = f"{h_cal[0].shape[0]} calibration and " if h_cal else ""
    say(f"captured {cal}{h_ho[0].shape[0]} held-out tokens x {a.n_layers} layers ({time.time() - t0:.0f} s)")
    gate_ups = [model.weights.layer(i).gate_up for i in range(a.n_layers)]
    parts = []
    for i, gu in enumerate(gate_ups):
        if cfg.kind == INT2:
            parts.append(linear.encode(gu.dequantized(), INT2)[0])
        else:
            parts.append(fit_layer(gu.dequantized(), h_cal[i], min(cfg.rank or 128, a.dim)))
            h_cal[i] = None  # a layer's inputs are done with: free them
        if i % 7 == 6 or i == a.n_layers - 1:
            say(f"layer {i + 1}/{a.n_layers} made ({time.time() - t0:.0f} s)")
    if cfg.kind == INT2:
        p: Predictor = Int2Predictor({k: torch.stack([x[k] for x in parts]) for k in parts[0]}, gate_ups[0].n, {})
    else:
        p = LowRankPredictor(*(torch.stack(w) for w in zip(*parts)), {})
    k = top_k(cfg.density, a.ffn_dim)
    recall, mass = zip(
        *(recall_at_k(p.scores(i, h), activations(gu, h), k) for i, (gu, h) in enumerate(zip(gate_ups, h_ho)))
    )
    p.header = {
        "density": cfg.density,
        "recall": {
            "mean": sum(recall) / len(recall),
            "min": min(recall),
            "worst_layer": recall.index(min(recall)),
            "per_layer": list(recall),
            "mass": list(mass),
            "mass_mean": sum(mass) / len(mass),
            "heldout_prompts": len(heldout),
            "heldout_tokens": h_ho[0].shape[0],
        },
        "fitting": {
            "prompts": len(calibration) if cfg.kind != INT2 else 0,
            "tokens_per_prompt": cfg.tokens,
            "seconds": round(time.time() - t0, 1),
        },
    }
    return p
