"""What a forward hands out, and the plan that says which parts go elsewhere.

`Transformer.forward_steps` is a generator of requests: it yields one when it needs something it
does not compute itself and takes the answer through `send`. It always asks for weights
(`NeedWeights`); with a `ForwardPlan` it also hands out the parts a second unit shares
(Ghidorah): each layer's attention (`SplitAttention`), each linear layer's output columns
(`SplitColumns`). Who computes what, and where, is the executor's business (actors/executor.py);
the model only says what it needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models.attention import Visibility


@dataclass(frozen=True)
class ForwardPlan:
    """One forward's split, decided before it starts.

    attn_split: every layer's attention goes out as a `SplitAttention` (answer: the output [T, H, D]).
    column_share > 0: every linear layer goes out as a `SplitColumns` (fused CPU path only); the residual
    stream, the linears' inputs and their outputs then live in `bufs` (flat fp32, shared with the other
    unit: residual, inputs, outputs), each big enough for T rows of the widest of them.
    """

    attn_split: bool = False
    column_share: float = 0.0
    bufs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def __post_init__(self):
        if not 0.0 <= self.column_share < 1.0:
            raise ValueError(f"ForwardPlan.column_share is a share in [0, 1); got {self.column_share}")
        if self.column_share > 0 and (self.bufs is None or len(self.bufs) != 3):
            raise ValueError("ForwardPlan.column_share > 0 needs bufs: (residual, linear inputs, linear outputs)")


@dataclass(frozen=True)
class NeedWeights:
    """The weights of one store group: a layer ("layer.7", index 7) or a part of the output head ("head.0")."""

    group: str
    index: int

    @property
    def head(self) -> bool:
        return self.group.startswith("head.")


@dataclass(frozen=True)
class NeedExperts:
    """The experts of MoE layer `layer` that the forward's tokens route to (ascending: the union over its rows;
    a token tree needs every expert any of its tokens chose). `guess`: the next layer's experts as its router
    scores this layer's input (next-router lookahead), () when not asked for. Answer: {expert: ExpertWeights}."""

    layer: int
    experts: tuple[int, ...]
    guess: tuple[int, ...] = ()


@dataclass(frozen=True)
class SplitAttention:
    """Attention of layer `layer`: queries q [T, H, D] over the layer's cached keys and values k, v
    [Hkv, capacity, D], each row seeing the slots `vis` gives it; answer with the output [T, H, D]."""

    layer: int
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    vis: Visibility


@dataclass(frozen=True)
class SplitColumns:
    """y[:, :] = x W^T (or y += x W^T when `accumulate`) for one linear layer; x and y are views of the plan's
    `bufs`; answer with None once every column of y is written."""

    layer: int
    name: str  # qkv | attn_out | gate_up | down
    linear: object  # models.linear.Linear
    x: torch.Tensor  # [T, linear.k]
    y: torch.Tensor  # [T, linear.n]
    accumulate: bool


def weights_for(weights, need):
    """What `Transformer.forward_steps` asked for: a layer or a head part (`models.requests.NeedWeights`), or
    a layer's experts ({expert: ExpertWeights}, for a `models.requests.NeedExperts`)."""
    if not hasattr(need, "head"):
        return weights.experts(need)
    return weights.head_part(need.index) if need.head else weights.layer(need.index)


def drive(steps, weights):
    """Run a `Transformer.forward_steps`-style generator to the end with weights from `weights`."""
    need = next(steps)
    try:
        while True:
            need = steps.send(weights_for(weights, need))
    except StopIteration as done:
        return done.value
