"""The target for LLM in a flash (§3-§4): attention, norms and the output head resident; each layer's FFN a
`FlashFFN` that computes only the neurons the predictor picks for the tokens at hand, from the layer's
neuron cache, loading the bundles the cache lacks.

A block of many rows (a prompt) takes the dense FFN instead, read whole from the store for the pass: the
prompt is processed exactly as the target does, and no cache could hold the union of its rows' neurons.
`density` 1.0 does so for every pass: the target itself, bit for bit.
"""

from __future__ import annotations

import mmap
import time
from dataclasses import dataclass

import numpy as np
import torch

from common.errors import CadenceError
from models import kernels
from models import flash_records as records
from flash.reader import BundleReader, ReadCount
from flash.cache import NeuronCache
from flash.footprint import FFN, check_kind, top_k
from flash.predictor import Predictor
from formats.store import WeightStore
from formats.weights import LayerWeights, StreamingWeights, layer_from_views, store_linear
from shm.dio import ALIGN, DirectReader

DENSE_ROWS = 8  # a pass of more rows than this takes the dense FFN (a prompt's prefill)


@dataclass
class FlashStats:
    """What the flash FFNs did since the last reset: passes per path, neurons, and what they read (the bundle
    reader's own count, `bundles`; the dense FFNs' reads, `dense`)."""

    bundles: ReadCount
    dense: ReadCount
    sparse_passes: int = 0
    dense_passes: int = 0
    neurons: int = 0  # predicted neurons over sparse passes (a layer's union over its rows)
    loaded: int = 0  # of them, read from the bundles

    @property
    def hit_rate(self) -> float:
        return 1.0 - self.loaded / self.neurons if self.neurons else 0.0

    def as_dict(self) -> dict:
        b, d = self.bundles, self.dense
        return {
            "sparse_passes": self.sparse_passes,
            "dense_passes": self.dense_passes,
            "neurons": self.neurons,
            "loaded": self.loaded,
            "hit_rate": round(self.hit_rate, 4),
            "bundle_bytes": b.bytes,
            "dense_bytes": d.bytes,
            "reads": b.reads + d.reads,
            "read_s": round(b.seconds + d.seconds, 4),
            "layer_reads": b.layers,  # the cost model chose the layer's whole region
        }


def _attention_only(w: LayerWeights) -> LayerWeights:
    """A layer's weights without its FFN, every array copied out of the group's buffer (which is freed)."""
    keep = lambda t: None if t is None else t.clone()
    lin = lambda x: None if x is None else _clone_linear(x)
    return LayerWeights(
        attn_norm=keep(w.attn_norm),
        qkv=lin(w.qkv),
        attn_out=lin(w.attn_out),
        ffn_norm=keep(w.ffn_norm),
        q_norm=keep(w.q_norm),
        k_norm=keep(w.k_norm),
    )


def _clone_linear(x):
    import copy

    y = copy.copy(x)
    if hasattr(x, "arrays"):
        y.arrays = {k: v.clone() for k, v in x.arrays.items()}
    if getattr(x, "w", None) is not None:
        y.w = x.w.clone()
    if getattr(x, "bias", None) is not None:
        y.bias = x.bias.clone()
    return y


class FlashWeights:
    """A weight provider (formats/weights.py) for `Transformer`: `layer(i)` carries `flash`, the layer's FFN."""

    def __init__(self, store: WeightStore, predictor: Predictor | None, density: float, head_rows: int | None = None):
        """The caches come after (`allocate`): sized from what this process holds once everything else is in (the
        predictor too, which may be set after, before the first pass).
        `head_rows`: the output head keeps only the rows of the tokens below that id (FR-Spec, a draft's head)."""
        a = store.args
        check_kind(store)
        if not 0.0 < density <= 1.0:
            raise CadenceError(f"--ffn-density {density} must be above 0 and at most 1")
        self.store, self.args, self.predictor, self.density = store, a, predictor, density
        self.k = top_k(density, a.ffn_dim)
        self.capacity = 0
        self.record = records.record_bytes(a.dim)
        self.head_groups = store.head_groups()
        self.reader = BundleReader(store)
        self.dense_reads = ReadCount()
        self.stats = FlashStats(self.reader.stats, self.dense_reads)
        self.layers: list[LayerWeights] = []
        self.head_rows = head_rows
        self._load_resident()

    def _ffn_span(self, i: int) -> tuple[int, int]:
        arrays = [a for t in FFN for a in self.store.tensors[f"blk.{i}.{t}"]["arrays"].values()]
        lo = min(a["offset"] for a in arrays)
        return lo, max(a["offset"] + a["nbytes"] for a in arrays) - lo

    def _load_resident(self) -> None:
        """Each layer read once through one mapped buffer (unmapped after: a heap buffer freed per layer would
        leave the allocator holding it), its attention copied out; the head and the embedding's rows as a
        streamed run keeps them (`StreamingWeights`: the head resident, the embedding on disk); the dense FFN
        of a prompt's pass read per layer into one scratch buffer."""
        store = self.store
        self.resident = StreamingWeights(store, set(self.head_groups), self.head_rows)
        self.embed, self.ple = self.resident.embed, self.resident.ple
        self.spans = [self._ffn_span(i) for i in range(self.args.n_layers)]
        # page-aligned and read at the file's phase within a page: direct reads land in it with no bounce
        # buffers (4 MiB a reader thread otherwise)
        self.scratch = torch.frombuffer(mmap.mmap(-1, max(n for _, n in self.spans) + ALIGN), dtype=torch.uint8)
        self.dense_reader = DirectReader(store.path, threads=4)
        groups = [store.groups[f"layer.{i}"] for i in range(self.args.n_layers)]
        tmp = mmap.mmap(-1, max(g.nbytes for g in groups))
        try:
            with open(store.path, "rb", buffering=0) as f:
                for i, g in enumerate(groups):
                    buf = torch.frombuffer(tmp, dtype=torch.uint8, count=g.nbytes)
                    f.seek(g.offset)
                    f.readinto(memoryview(tmp)[: g.nbytes])
                    w = _attention_only(layer_from_views(store, i, store.views(g.name, buf)))
                    w.flash = FlashFFN(self, i, None)
                    self.layers.append(w)
                    del buf, w
        finally:
            import gc

            gc.collect()  # the views of the mapped buffer go before it is unmapped
            tmp.close()

    def allocate(self, capacity: int) -> None:
        """Each layer's neuron cache, `capacity` neurons (at least a token's `k`; density 1.0 needs none)."""
        if self.density >= 1.0:
            return
        capacity = min(capacity, self.args.ffn_dim)
        if capacity < self.k:
            raise CadenceError(
                f"the neuron cache holds {capacity} neurons a layer and a token needs {self.k} at --ffn-density "
                f"{self.density}; give a larger --memory-budget or a lower --ffn-density"
            )
        self.capacity = capacity
        for w in self.layers:
            w.flash.cache = NeuronCache(self.args.ffn_dim, capacity, self.record)

    # -- the provider ---------------------------------------------------------------------------------

    def layer(self, i: int) -> LayerWeights:
        return self.layers[i]

    def head_part(self, j: int):
        return self.resident.head_part(j)

    def experts(self, need):
        raise CadenceError("--mode flash runs dense FFN models only")

    def nbytes(self) -> int:
        """Resident bytes: attention, norms, head, the neuron caches, the dense scratch and the predictor."""
        n = self.scratch.numel() + self.predictor.nbytes
        for w in self.layers:
            for x in (w.qkv, w.attn_out):
                n += x.nbytes()
            n += w.flash.cache.nbytes if w.flash.cache is not None else 0
        return n + self.resident.nbytes()

    def reset_stats(self) -> None:
        self.reader.stats, self.dense_reads = ReadCount(), ReadCount()  # two counts: bundle reads, dense reads
        self.stats = FlashStats(self.reader.stats, self.dense_reads)

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
            self.dense_reader.close()
            self.embed.close()
            self.reader = None

    # -- reads ----------------------------------------------------------------------------------------

    def dense_ffn(self, i: int):
        """Layer i's dense FFN (gate_up, down), read from the store into the scratch buffer."""
        lo, n = self.spans[i]
        t0 = time.perf_counter()
        at = lo % ALIGN
        self.dense_reader.read_into(lo, n, self.scratch.numpy(), dest_offset=at)
        self.dense_reads.add(n, 1, time.perf_counter() - t0)
        names = [f"blk.{i}.{t}" for t in FFN]
        views = self.store.tensor_views(names, self.scratch[at:], lo)
        return [store_linear(self.store, name, views[name]) for name in names]


class FlashFFN:
    """One layer's FFN under LLM in a flash: called with the FFN input h [T, dim], it adds the FFN's output
    to x (the residual stream) in place."""

    def __init__(self, parent: FlashWeights, layer: int, cache: NeuronCache):
        self.parent, self.layer, self.cache = parent, layer, cache
        self.step = 0

    def __call__(self, h: torch.Tensor, x: torch.Tensor) -> None:
        p = self.parent
        if p.density >= 1.0 or h.shape[0] > DENSE_ROWS:
            return self._dense(h, x)
        rows = p.predictor.top(self.layer, h, p.k).numpy()  # ascending per row
        ids = rows[0] if h.shape[0] == 1 else np.unique(rows)
        if ids.size > self.cache.capacity:  # rows whose neurons together outgrow the cache: one row at a time
            for r in range(h.shape[0]):
                self._sparse(h[r : r + 1], x[r : r + 1], rows[r])
            return
        self._sparse(h, x, ids)

    def _sparse(self, h: torch.Tensor, x: torch.Tensor, ids: np.ndarray) -> None:
        """The FFN over the neurons `ids` (ascending), from the cache (loading what it lacks), added into x."""
        p = self.parent
        self.step += 1
        self._load(ids)
        kernels.flash_ffn(h, self.cache.matrix, self.cache.slots(ids), x)
        p.stats.sparse_passes += 1
        p.stats.neurons += int(ids.size)

    def _dense(self, h: torch.Tensor, x: torch.Tensor) -> None:
        gate_up, down = self.parent.dense_ffn(self.layer)
        down.matmul(kernels.swiglu(gate_up.matmul(h)), out=x)
        self.parent.stats.dense_passes += 1

    def _load(self, ids: np.ndarray) -> None:
        """The window's step (§3.1): mark `ids` active, drop what left the window (or, under a fixed capacity,
        the least recently active), and bring the neurons the cache lacks: their bundles, or the layer's whole
        region where the cost model prices that lower (§4.2)."""
        p, cache = self.parent, self.cache
        miss = cache.admit(ids, self.step)  # no window but the capacity: a neuron stays until its row is wanted
        if miss.size:
            recs, _ = p.reader.load(self.layer, miss)  # counted in the reader's stats (FlashStats.bundles)
            p.stats.loaded += int(miss.size)
            cache.insert(miss, recs, self.step)
