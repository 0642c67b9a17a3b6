"""Reading neuron records from a store's bundle file (LLM in a flash §3.2, §4.2), around the page cache.

`BundleReader.read(layer, neurons)` reads the 4 KiB blocks covering those neurons' records (a record may
straddle two), runs of neighbouring blocks as one read, runs merged through a gap where the cost model says
the longer read is cheaper, many reads in flight (shm/dio.py's `DirectReader.read_ranges`: O_DIRECT, or
buffered reads dropped from the page cache where the file lives in memory), and returns exactly those
records in the order given. `read_layer(layer)` reads a layer's whole FFN in one large read; `load` does
whichever of the two `plan` prices lower. Every read is counted in `stats` (bytes, reads), so a run can say
what it read per token.
"""

from __future__ import annotations

import mmap
import threading
from dataclasses import dataclass

import numpy as np
import torch

from flash import bundles
from flash.costmodel import ALIGN, Choice, ReadCurve, choose, chunk_starts, machine_curve, record_blocks
from formats.store import WeightStore
from shm.dio import DirectReader


@dataclass
class ReadCount:
    """What a reader read: bytes, reads (one per range), the calls that read a whole layer, seconds spent."""

    bytes: int = 0
    reads: int = 0
    layers: int = 0
    seconds: float = 0.0

    def add(self, nbytes: int, reads: int, seconds: float, layer: bool = False) -> None:
        self.bytes += nbytes
        self.reads += reads
        self.layers += int(layer)
        self.seconds += seconds


class BundleReader:
    """One store's bundle file open for direct reads; thread-safe (calls take turns on one scratch buffer)."""

    def __init__(self, store: WeightStore, curve: ReadCurve | None = None, threads: int = 32, warn=None):
        self.store = store
        self.layout = bundles.Layout.of(store)
        self.orders = bundles.read_orders(store, self.layout)
        self.positions = [np.argsort(o) for o in self.orders]  # neuron -> position
        self.curve = curve or machine_curve(store.path, warn)
        self.record = self.layout.record
        self.io = DirectReader(store.dir / bundles.FILE, threads=threads, warn=warn)
        self.stats = ReadCount()
        self._lock = threading.Lock()
        self._scratch: mmap.mmap | None = None

    @property
    def direct(self) -> bool:
        return self.io.direct

    def close(self) -> None:
        self.io.close()
        if self._scratch is not None:
            self._scratch.close()
            self._scratch = None

    def __enter__(self) -> "BundleReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _starts(self, layer: int, neurons) -> np.ndarray:
        """File offsets of the records of `neurons` (int array) of `layer`."""
        lay = self.layout
        if not 0 <= layer < lay.n_layers:
            raise ValueError(f"layer {layer} is not one of the model's {lay.n_layers}")
        neurons = np.asarray(neurons, dtype=np.int64).reshape(-1)
        if neurons.size and (neurons.min() < 0 or neurons.max() >= lay.ffn_dim):
            raise ValueError(f"neurons must lie in [0, {lay.ffn_dim}); got {neurons.min()} .. {neurons.max()}")
        pos = self.positions[layer][neurons]
        return lay.start(layer) + chunk_starts(pos, self.record, lay.chunk_neurons)

    def plan(self, layer: int, neurons) -> Choice:
        """The price of reading these neurons' blocks against the whole layer's FFN (units: 4 KiB blocks)."""
        return choose(
            record_blocks(self._starts(layer, neurons), self.record), ALIGN, self.layout.layer_bytes, self.curve
        )

    def read(self, layer: int, neurons, out: torch.Tensor | None = None) -> torch.Tensor:
        """The records of `neurons` of `layer`, uint8 [n, record_bytes], in the order given (a neuron given twice
        comes twice, read once). `out`: where to put them (a uint8 [>= n, record_bytes] tensor)."""
        starts = self._starts(layer, neurons)
        out = self._out(out, starts.size)
        if starts.size:
            self._read_blocks(self.plan(layer, neurons).reads, starts, out)
        return out[: starts.size]

    def read_layer(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s whole FFN, uint8 [ffn_dim, record_bytes] in neuron order, in one large read."""
        lay = self.layout
        if not 0 <= layer < lay.n_layers:
            raise ValueError(f"layer {layer} is not one of the model's {lay.n_layers}")
        recs = self._layer_into(layer, mmap.mmap(-1, lay.layer_bytes))  # its own: the tensor returned views it
        if lay.order == "identity":
            return recs
        return recs[torch.from_numpy(self.positions[layer])]

    def _layer_into(self, layer: int, buf: mmap.mmap) -> torch.Tensor:
        """Layer `layer`'s chunks read into `buf` (page-aligned) in one read: its records in file order."""
        lay = self.layout
        st = self.io.read_into(lay.start(layer), lay.layer_bytes, buf)
        self.stats.add(lay.layer_bytes, 1, st.seconds, layer=True)
        body = torch.frombuffer(buf, dtype=torch.uint8)[: lay.layer_bytes].view(lay.chunks, lay.chunk_bytes)
        return body[:, : lay.chunk_neurons * self.record].reshape(-1, self.record)[: lay.ffn_dim]

    def load(self, layer: int, neurons, out: torch.Tensor | None = None) -> tuple[torch.Tensor, Choice]:
        """The records of `neurons`, read as `plan` prices lower: their blocks, or the whole layer."""
        choice = self.plan(layer, neurons)
        if choice.bundles:
            starts = self._starts(layer, neurons)
            out = self._out(out, starts.size)
            if starts.size:
                self._read_blocks(choice.reads, starts, out)
            return out[: starts.size], choice
        # the whole layer through the scratch buffer (no second layer-sized buffer), its records picked straight
        # into `out` (at their file positions where the layer's order is not the neurons')
        pos = np.asarray(neurons, dtype=np.int64).reshape(-1)
        if self.layout.order != "identity":
            pos = self.positions[layer][pos]
        out = self._out(out, pos.size)
        with self._lock:
            whole = self._layer_into(layer, self._ensure(self.layout.layer_bytes))
            torch.index_select(whole, 0, torch.from_numpy(pos), out=out[: pos.size])
        return out[: pos.size], choice

    def _out(self, out: torch.Tensor | None, n: int) -> torch.Tensor:
        if out is None:
            return torch.empty(n, self.record, dtype=torch.uint8)
        if out.dtype != torch.uint8 or out.dim() != 2 or out.shape[0] < n or out.shape[1] != self.record:
            raise ValueError(f"out must be uint8 [>= {n}, {self.record}]; got {out.dtype} {list(out.shape)}")
        return out

    def _read_blocks(self, reads, starts: np.ndarray, out: torch.Tensor) -> None:
        """Read `reads` ((first block, blocks) each) into the scratch buffer, back to back, then gather the
        records at file offsets `starts` into out[:n]."""
        firsts = np.asarray([a for a, _ in reads], dtype=np.int64)
        counts = np.asarray([n for _, n in reads], dtype=np.int64)
        dest_at = np.concatenate([[0], np.cumsum(counts)[:-1]]) * ALIGN
        total = int(counts.sum()) * ALIGN
        with self._lock:
            scratch = self._ensure(total)
            ranges = zip((firsts * ALIGN).tolist(), (counts * ALIGN).tolist(), dest_at.tolist())
            st = self.io.read_ranges(ranges, scratch)
            self.stats.add(total, len(reads), st.seconds)
            # each record lies inside one read: its place in the scratch is its read's place plus its offset in it
            k = np.searchsorted(firsts * ALIGN, starts, side="right") - 1
            at = dest_at[k] + starts - firsts[k] * ALIGN
            flat = torch.frombuffer(scratch, dtype=torch.uint8)[:total]
            rows = flat.unfold(0, self.record, 16)  # a record starts on a 16-byte boundary of the scratch
            torch.index_select(rows, 0, torch.from_numpy(at // 16), out=out[: starts.size])

    def _ensure(self, nbytes: int) -> mmap.mmap:
        """The scratch buffer (page-aligned, reused: faulted in once), grown to at least `nbytes`."""
        if self._scratch is None or len(self._scratch) < nbytes:
            if self._scratch is not None:
                self._scratch.close()
            self._scratch = mmap.mmap(-1, max(nbytes, 1 << 20))
        return self._scratch
