"""The activation predictors (LLM in a flash §3.1, Appendix B), one per layer: from the FFN's input h (the
attention output, normed) to the neurons that will matter for this token, before any FFN weight is read.

A neuron "matters" for a token when its |silu(gate . h) * (up . h)| is among that token's top `density`
share (SwiGLU activations are concentrated, not zero: a per-token top-k, see notes/ffn-sparsity.md). The
paper's predictor is for ReLU models, where the sign of one linear map of h decides; here the magnitude
rests on two (|up . h| alone ranks better than gate . h), so both predictors estimate the gate and up
products of every neuron and score it as the FFN would, score = |silu(g) * u|. Two kinds:

    low rank (`rN`)   [g, u] = (h W1^T) W2^T     W1 [rank, dim], W2 [2F, rank], fitted (train.py); bf16 in a run
    int2              [g, u] = Q2 h              the layer's own [gate; up] rounded to 2-bit codes (2.6 bits a
                                                 weight with the scales), computed by the int2 kernel

On the 1.5B, rank 128 (140 MB) finds 0.56 of each token's true top 30%, int2 (241 MiB) 0.79 (BENCHMARKS.md).
The caller takes each token's top k.

File: `predictor-{name}.npz` in the store's directory (numpy's zip: per-member CRC, no pickle): `header`, a
JSON string (the model it was made for: the store's source digest and shape; the density it was evaluated at
and the recall measured on held-out tokens), and the arrays: w1 [L, rank, dim] and w2 [L, 2F, rank] fp16 (low
rank), or the int2 layout's q, sc, mn, s, m with a leading [L] (int2, models/linear_int2.py).
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from common.errors import CadenceError
from models import linear, tiles
from flash.footprint import INT2, TRAIN, best_predictor, file_name
from formats.store import WeightStore

VERSION = 1


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


def gate_up_scores(gu: torch.Tensor) -> torch.Tensor:
    """[T, 2F] gate products, then up products -> |silu(gate) * up| [T, F]."""
    g, u = gu.float().chunk(2, dim=-1)
    return F.silu(g).mul_(u).abs_()


def activations(gate_up, h: torch.Tensor) -> torch.Tensor:
    """|silu(gate . h) * (up . h)| [T, F] of a SwiGLU FFN with the layer's own (quantized) weights."""
    return gate_up_scores(gate_up.matmul(h))


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
    """Per-layer scorers of every FFN neuron (`scores`); the kinds differ in how they estimate the gate and up
    products (`gate_up`) and in what they keep (`arrays`, saved as they are)."""

    def __init__(self, header: dict):
        self.header = header

    @property
    def name(self) -> str:
        raise NotImplementedError

    @property
    def density(self) -> float:
        return float(self.header["density"])

    @property
    def recall(self) -> dict:
        """Measured at fitting on held-out tokens at `density`: mean, min, worst_layer, per_layer (recall@k),
        mass (per layer: the share of the true top-k's activation the predicted top-k holds), mass_mean."""
        return dict(self.header.get("recall", {}))

    def arrays(self) -> dict[str, np.ndarray]:
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        """Bytes in memory (as in the file)."""
        return sum(a.nbytes for a in self.arrays().values())

    def gate_up(self, i: int, h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def scores(self, i: int, h: torch.Tensor) -> torch.Tensor:
        """h [T, dim] (layer i's FFN input) -> [T, F]: the predicted |activation| of each neuron."""
        return gate_up_scores(self.gate_up(i, h))

    def top(self, i: int, h: torch.Tensor, k: int) -> torch.Tensor:
        """The k best-scored neurons of layer i per token, int64 [T, k], ascending ids (the order reads go in)."""
        return self.scores(i, h).topk(k, dim=-1, sorted=False).indices.sort(dim=-1).values

    def save(self, store: WeightStore) -> Path:
        """Written beside the store's weights (to a temporary name first: a reader never sees half a file)."""
        path = store.dir / file_name(self.name)
        tmp = path.with_name(path.name + ".tmp")
        header = dict(self.header, version=VERSION, model=identity(store), predictor=self.name)
        with open(tmp, "wb") as f:
            np.savez(f, header=np.array(json.dumps(header)), **self.arrays())
        tmp.replace(path)
        self.header = header
        return path

    @staticmethod
    def load(store: WeightStore, name: str | None = None, dtype: torch.dtype = torch.float32) -> "Predictor":
        """The store's predictor `name` (default: the best, footprint.predictors); `dtype`: a low-rank one's in
        memory (bf16: half of fp32, for a run under a budget)."""
        train = TRAIN.format(model=store.dir.name)
        name = best_predictor(store) if name is None else name
        path = store.dir / file_name(name)
        if not path.is_file():
            raise CadenceError(f"{path} does not exist; {train}")
        arrays, header = _read(path, train)
        want = identity(store)
        if not isinstance(header, dict) or header.get("version") != VERSION:
            raise CadenceError(f"{path} was written by another cadence version; delete it and {train}")
        if header.get("model") != want:
            raise CadenceError(
                f"{path} was trained for another model ({header.get('model')}, this store is {want}); delete it "
                f"and {train}"
            )
        expect = Int2Predictor.shapes(want) if name == INT2 else LowRankPredictor.shapes(want, int(name[1:]))
        got = {k: (a.shape, a.dtype) for k, a in arrays.items()}
        if got != expect:
            raise CadenceError(f"{path} is damaged (arrays {got}); delete it and {train}")
        t = {k: torch.from_numpy(a) for k, a in arrays.items()}
        if name == INT2:
            return Int2Predictor(t, 2 * want["ffn_dim"], header)
        return LowRankPredictor(t["w1"], t["w2"], header, dtype)


class LowRankPredictor(Predictor):
    """Per-layer low-rank scorers (`rN`), fp32 in memory (fp16 on disk; `dtype=torch.bfloat16`: half the
    memory, for a run under a budget)."""

    def __init__(self, w1: torch.Tensor, w2: torch.Tensor, header: dict, dtype: torch.dtype = torch.float32):
        super().__init__(header)
        self.w1t = w1.to(dtype).transpose(1, 2).contiguous()  # [L, dim, rank]
        self.w2t = w2.to(dtype).transpose(1, 2).contiguous()  # [L, rank, 2F]

    @property
    def rank(self) -> int:
        return self.w1t.shape[2]

    @property
    def name(self) -> str:
        return f"r{self.rank}"

    @staticmethod
    def shapes(model: dict, rank: int) -> dict:
        L, d, f = model["n_layers"], model["dim"], model["ffn_dim"]
        return {"w1": ((L, rank, d), np.float16), "w2": ((L, 2 * f, rank), np.float16)}

    def arrays(self) -> dict[str, np.ndarray]:
        return {"w1": self.w1t.transpose(1, 2).half().numpy(), "w2": self.w2t.transpose(1, 2).half().numpy()}

    @property
    def nbytes(self) -> int:
        return self.w1t.element_size() * (self.w1t.numel() + self.w2t.numel())

    def gate_up(self, i: int, h: torch.Tensor) -> torch.Tensor:
        return (h.to(self.w1t.dtype) @ self.w1t[i]) @ self.w2t[i]


class Int2Predictor(Predictor):
    """Each layer's own [gate; up] weights in int2 (models/linear_int2.py), multiplied by the int2 kernel: the
    FFN's own products, coarsely rounded."""

    def __init__(self, arrays: dict[str, torch.Tensor], n: int, header: dict):
        """`arrays`: the int2 layout's arrays of every layer, each with a leading [L]; `n`: 2F rows a layer."""
        super().__init__(header)
        self.stacked = arrays
        self.layers = [
            linear.decode(INT2, {k: v[i] for k, v in arrays.items()}, {"n": n}) for i in range(len(arrays["q"]))
        ]

    @property
    def name(self) -> str:
        return INT2

    @staticmethod
    def shapes(model: dict) -> dict:
        arrays, _ = linear.encode(torch.zeros(tiles.TILE, model["dim"]), INT2)  # one tile: the arrays' widths
        n = tiles.count(2 * model["ffn_dim"])
        return {k: ((model["n_layers"], n, a.shape[1]), a.numpy().dtype) for k, a in arrays.items()}

    def arrays(self) -> dict[str, np.ndarray]:
        return {k: v.numpy() for k, v in self.stacked.items()}

    def gate_up(self, i: int, h: torch.Tensor) -> torch.Tensor:
        return self.layers[i].matmul(h.float().contiguous())


def _read(path: Path, train: str):
    try:
        with np.load(path, allow_pickle=False) as z:
            header = json.loads(str(z["header"]))
            return {k: z[k] for k in z.files if k != "header"}, header
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, json.JSONDecodeError) as e:
        raise CadenceError(f"{path} is damaged or truncated ({e}); delete it and {train}") from None
