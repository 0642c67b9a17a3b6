"""Fitting the low-rank activation predictor (models/flash/predictor.py) on the model's own activations.

For each calibration prompt the dense model continues greedily (the text it meets when it generates); every
layer's FFN input h is recorded on the way, the prompt's tokens and the continuation's. The kernels give a
row the same result alone or in a block, so these are the inputs a teacher-forced pass over prompt and
continuation would see.

Per layer, W2 W1 is the rank-r map closest to the layer's own [gate; up] weights W (int4, dequantized) on
those inputs: it minimises E ||W h - W2 W1 h||^2, which with C = E[h h^T] = L L^T is the truncated SVD of
W L (Eckart-Young in C's metric). Closed form, seconds a layer; on the 1.5B it ranks neurons better than
a linear scorer of the same size trained with BCE and Adam against top-k labels (the paper's recipe for
ReLU models), which cannot express |up . h|. Recall is measured against the true per-token top `density`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from models.flash.footprint import top_k
from models.flash.predictor import Predictor, activations, recall_at_k
from models.transformer import Transformer


@dataclass(frozen=True)
class FitConfig:
    rank: int = 128
    density: float = 0.3  # the share of neurons recall is measured at
    tokens: int = 64  # generated per prompt


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
    """A predictor for every layer of `model` (a dense SwiGLU transformer, every layer at hand), its recall
    measured on the `heldout` prompts' tokens and continuations."""
    a = model.args
    t0 = time.time()
    h_cal = capture(model, calibration, cfg.tokens)
    h_ho = capture(model, heldout, cfg.tokens)
    say(
        f"captured {h_cal[0].shape[0]} calibration and {h_ho[0].shape[0]} held-out tokens "
        f"x {a.n_layers} layers ({time.time() - t0:.0f} s)"
    )
    k, n_ho, rank = top_k(cfg.density, a.ffn_dim), h_ho[0].shape[0], min(cfg.rank, a.dim)
    w1s, w2s, recall, mass = [], [], [], []
    t1 = time.time()
    for i in range(a.n_layers):
        gate_up = model.weights.layer(i).gate_up
        w1, w2 = fit_layer(gate_up.dequantized(), h_cal[i], rank)
        p = Predictor(w1[None], w2[None], {})
        r, m = recall_at_k(p.scores(0, h_ho[i]), activations(gate_up, h_ho[i]), k)
        w1s.append(w1), w2s.append(w2), recall.append(r), mass.append(m)
        h_cal[i] = h_ho[i] = None  # a layer's inputs are done with: free them
        if i % 7 == 6 or i == a.n_layers - 1:
            say(f"layer {i + 1}/{a.n_layers}: recall@{cfg.density:g} {r:.3f}, mass {m:.3f} ({time.time() - t1:.0f} s)")
    header = {
        "density": cfg.density,
        "recall": {
            "mean": sum(recall) / len(recall),
            "min": min(recall),
            "worst_layer": recall.index(min(recall)),
            "per_layer": recall,
            "mass": mass,
            "mass_mean": sum(mass) / len(mass),
            "heldout_prompts": len(heldout),
            "heldout_tokens": n_ho,
        },
        "fitting": {
            "prompts": len(calibration),
            "tokens_per_prompt": cfg.tokens,
            "seconds": round(time.time() - t0, 1),
        },
    }
    return Predictor(torch.stack(w1s), torch.stack(w2s), header)
