"""The low-rank activation predictor (LLM in a flash §3.1, Appendix B), one per layer: from the FFN's input h
(the attention output, normed) to the neurons that will matter for this token, before any FFN weight is read.

A neuron "matters" for a token when its |silu(gate . h) * (up . h)| is among that token's top `density`
share (SwiGLU activations are concentrated, not zero: a per-token top-k, see notes/ffn-sparsity.md). The
paper's predictor is for ReLU models, where the sign of one linear map of h decides; here the magnitude
rests on two (|up . h| alone ranks better than gate . h), so the predictor is a rank-r model of both,
sharing one projection, and scores a neuron as the FFN would:

    [g, u] = (h W1^T) W2^T        W1 [rank, dim], W2 [2F, rank] (gate rows, then up rows)
    score  = |silu(g) * u|

The caller takes each token's top k. Fitted by models/flash/train.py.

File: `predictor-r{rank}.npz` in the store's directory (numpy's zip: per-member CRC, no pickle), arrays
w1 [L, rank, dim] and w2 [L, 2F, rank] fp16 and `header`, a JSON string: the model it was fitted for (the
store's source digest and shape), the density it was evaluated at and the recall measured on held-out tokens.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from common.errors import CadenceError
from models.flash.footprint import TRAIN, best_rank
from models.store import WeightStore

VERSION = 1


def file_name(rank: int) -> str:
    return f"predictor-r{rank}.npz"


def identity(store: WeightStore) -> dict:
    """What a predictor must match: the store's source weights and the shape of its FFNs."""
    a = store.args
    return {
        "source_sha256": store.manifest["source"]["sha256"],
        "arch": a.arch,
        "n_layers": a.n_layers,
        "dim": a.dim,
        "ffn_dim": a.ffn_dim,
    }


def activations(gate_up, h: torch.Tensor) -> torch.Tensor:
    """|silu(gate . h) * (up . h)| [T, F] of a SwiGLU FFN with the layer's own (quantized) weights."""
    g, u = gate_up.matmul(h).chunk(2, dim=-1)
    return (F.silu(g) * u).abs()


def top_mask(act: torch.Tensor, k: int) -> torch.Tensor:
    """[T, F] bool: each token's k largest activations."""
    mask = torch.zeros(act.shape, dtype=torch.bool)
    return mask.scatter_(1, act.topk(k, dim=-1).indices, True)


def recall_at_k(scores: torch.Tensor, act: torch.Tensor, k: int) -> tuple[float, float]:
    """(|predicted top-k ∩ true top-k| / k, the share of the true top-k's activation mass the predicted top-k
    holds), means over the tokens."""
    pred = scores.topk(k, dim=-1).indices
    true = act.topk(k, dim=-1)
    hit = top_mask(act, k).gather(1, pred).float().sum(-1) / k
    mass = act.gather(1, pred).sum(-1) / true.values.sum(-1).clamp_min(1e-30)
    return hit.mean().item(), mass.mean().item()


class Predictor:
    """Per-layer low-rank scorers, fp32 in memory (fp16 on disk; `dtype=torch.bfloat16`: half the memory, for a
    run under a budget)."""

    def __init__(self, w1: torch.Tensor, w2: torch.Tensor, header: dict, dtype: torch.dtype = torch.float32):
        self.w1t = w1.to(dtype).transpose(1, 2).contiguous()  # [L, dim, rank]
        self.w2t = w2.to(dtype).transpose(1, 2).contiguous()  # [L, rank, 2F]
        self.header = header

    @property
    def rank(self) -> int:
        return self.w1t.shape[2]

    @property
    def density(self) -> float:
        return float(self.header["density"])

    @property
    def recall(self) -> dict:
        """Measured at fitting on held-out tokens at `density`: mean, min, worst_layer, per_layer (recall@k),
        mass (per layer: the share of the true top-k's activation the predicted top-k holds), mass_mean."""
        return dict(self.header.get("recall", {}))

    @property
    def nbytes(self) -> int:
        """Bytes in memory."""
        return self.w1t.element_size() * (self.w1t.numel() + self.w2t.numel())

    def scores(self, i: int, h: torch.Tensor) -> torch.Tensor:
        """h [T, dim] (layer i's FFN input) -> [T, F]: the predicted |activation| of each neuron."""
        g, u = ((h.to(self.w1t.dtype) @ self.w1t[i]) @ self.w2t[i]).float().chunk(2, dim=-1)
        return F.silu(g).mul_(u).abs_()

    def top(self, i: int, h: torch.Tensor, k: int) -> torch.Tensor:
        """The k best-scored neurons of layer i per token, int64 [T, k], ascending ids (the order reads go in)."""
        return self.scores(i, h).topk(k, dim=-1, sorted=False).indices.sort(dim=-1).values

    def save(self, store: WeightStore) -> Path:
        """Written beside the store's weights (to a temporary name first: a reader never sees half a file)."""
        path = store.dir / file_name(self.rank)
        tmp = path.with_name(path.name + ".tmp")
        header = dict(self.header, version=VERSION, model=identity(store), rank=self.rank)
        w1, w2 = (t.transpose(1, 2).half().numpy() for t in (self.w1t, self.w2t))
        with open(tmp, "wb") as f:
            np.savez(f, header=np.array(json.dumps(header)), w1=w1, w2=w2)
        tmp.replace(path)
        self.header = header
        return path

    @classmethod
    def load(cls, store: WeightStore, rank: int | None = None, dtype: torch.dtype = torch.float32) -> "Predictor":
        """The store's predictor of `rank` (default: the highest rank there)."""
        train = TRAIN.format(model=store.dir.name)
        rank = best_rank(store) if rank is None else rank
        path = store.dir / file_name(rank)
        if not path.is_file():
            raise CadenceError(f"{path} does not exist; {train}")
        w1, w2, header = _read(path, train)
        _check(path, header, identity(store), (w1, w2), rank, train)
        return cls(torch.from_numpy(w1), torch.from_numpy(w2), header, dtype)


def _read(path: Path, train: str):
    try:
        with np.load(path, allow_pickle=False) as z:
            header = json.loads(str(z["header"]))
            return z["w1"], z["w2"], header
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, json.JSONDecodeError) as e:
        raise CadenceError(f"{path} is damaged or truncated ({e}); delete it and {train}") from None


def _check(path: Path, header, want: dict, arrays, rank: int, train: str) -> None:
    if not isinstance(header, dict) or header.get("version") != VERSION:
        raise CadenceError(f"{path} was written by another cadence version; delete it and {train}")
    if header.get("model") != want:
        raise CadenceError(
            f"{path} was trained for another model ({header.get('model')}, this store is {want}); delete it and {train}"
        )
    L, d, f = want["n_layers"], want["dim"], want["ffn_dim"]
    shapes = [a.shape for a in arrays]
    if shapes != [(L, rank, d), (L, 2 * f, rank)] or any(a.dtype != np.float16 for a in arrays):
        raise CadenceError(f"{path} is damaged (arrays {shapes}); delete it and {train}")
