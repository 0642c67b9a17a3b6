"""The bundled FFN layout (LLM in a flash §3.2) beside a weight store: `bundles.bin` and a `bundles` section
in the store's manifest. The dense layout (`weights.bin`) is left as it is, byte for byte.

Neuron i of a layer is one record (models/flash_records.py: its gate row, its up row and its down column,
int4), so the reads of a neuron bring everything it needs. The gate and up rows are the dense store's own
rows (the same codes and scales); the down column is quantized afresh from the model's source, along the model
dimension. A layer's records follow a neuron order (identity by default) and are packed `chunk_neurons` to a
chunk, back to back (a record may straddle 4 KiB blocks), each chunk padded to whole 4 KiB blocks. File:

    layer 0: chunk 0 .. chunk C-1 | order int32 [F] (position -> neuron), padded to 4 KiB | layer 1: ...

The layout follows from (record bytes, chunk_neurons, F, layers) alone; the manifest keeps it and `Layout.of`
checks the two agree, and the file's size.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from common.errors import CadenceError
from models import linear
from models import flash_records as records
from flash.costmodel import aligned
from flash.footprint import check_kind
from formats.store import WeightStore

FILE = "bundles.bin"
VERSION = 1


def _again(store: WeightStore) -> str:
    return f"write them again with `launch models bundle {store.dir}`"


@dataclass(frozen=True)
class Layout:
    """Where everything of the bundle file lies; the `bundles` section of a store's manifest."""

    dim: int
    ffn_dim: int
    n_layers: int
    record: int  # bytes per neuron
    chunk_neurons: int
    order: str  # "identity" or "given"
    source_sha256: str

    @property
    def chunk_bytes(self) -> int:
        return aligned(self.chunk_neurons * self.record)

    @property
    def chunks(self) -> int:
        return -(-self.ffn_dim // self.chunk_neurons)

    @property
    def layer_bytes(self) -> int:
        """A layer's chunks: its whole FFN, in one contiguous read."""
        return self.chunks * self.chunk_bytes

    @property
    def stride(self) -> int:
        return self.layer_bytes + aligned(4 * self.ffn_dim)

    @property
    def file_bytes(self) -> int:
        return self.n_layers * self.stride

    def start(self, layer: int) -> int:
        """Offset of layer `layer`'s first chunk in the file."""
        return layer * self.stride

    def order_at(self, layer: int) -> int:
        return self.start(layer) + self.layer_bytes

    def to_dict(self) -> dict:
        return {
            "version": VERSION,
            "file": FILE,
            "format": "int4",
            "dim": self.dim,
            "ffn_dim": self.ffn_dim,
            "n_layers": self.n_layers,
            "record_bytes": self.record,
            "chunk_neurons": self.chunk_neurons,
            "chunk_bytes": self.chunk_bytes,
            "layers": [[self.start(i), self.order_at(i)] for i in range(self.n_layers)],
            "order": self.order,
            "source_sha256": self.source_sha256,
            "file_bytes": self.file_bytes,
        }

    @classmethod
    def of(cls, store: WeightStore) -> "Layout":
        """The store's bundle layout, checked against its model and its file; one sentence when missing or
        damaged."""
        d = store.manifest.get("bundles")
        if d is None:
            raise CadenceError(f"{store.dir} has no FFN bundles; write them with `launch models bundle {store.dir}`")
        where = f"the bundles section of {store.dir / 'manifest.json'}"
        try:
            if d["version"] != VERSION:
                raise ValueError(f"version {d['version']}, this cadence reads {VERSION}")
            lay = cls(
                int(d["dim"]),
                int(d["ffn_dim"]),
                int(d["n_layers"]),
                int(d["record_bytes"]),
                int(d["chunk_neurons"]),
                str(d["order"]),
                str(d["source_sha256"]),
            )
            a = store.args
            if (lay.dim, lay.ffn_dim, lay.n_layers) != (a.dim, a.ffn_dim, a.n_layers) or lay.chunk_neurons < 1:
                raise ValueError("its shape is not this model's")
            if lay.record != records.record_bytes(a.dim) or d["format"] != "int4":
                raise ValueError(f"its records are not this cadence's ({records.record_bytes(a.dim)} bytes, int4)")
            if d != lay.to_dict():
                raise ValueError("its offsets do not follow from its shape")
        except (KeyError, TypeError, ValueError) as e:
            raise CadenceError(f"{where} is damaged ({e}); {_again(store)}") from None
        path = store.dir / FILE
        size = path.stat().st_size if path.is_file() else None
        if size != lay.file_bytes:
            got = "missing" if size is None else f"{size} bytes"
            raise CadenceError(f"{path} is {got}, the manifest says {lay.file_bytes} bytes; {_again(store)}")
        return lay


def check_store(store: WeightStore) -> None:
    """One sentence where a store cannot have bundles."""
    check_kind(store)
    records.check_dim(store.args.dim)


def source_of(store: WeightStore):
    """The model source the store was converted from (its down columns are quantized afresh from it)."""
    from formats.convert import open_source, source_identity

    src = store.manifest.get("source") or {}
    path = Path(src.get("path", ""))
    if not src.get("path") or not path.exists():
        raise CadenceError(
            f"the model {store.dir.name} was converted from ({path}) is gone; pull or convert it again "
            "(its FFN bundles are written from it)"
        )
    if source_identity(path) != src.get("sha256"):
        raise CadenceError(f"{path} is no longer the file {store.dir} was converted from; convert it again")
    return open_source(path, src["sha256"])


def layer_rows(store: WeightStore, i: int, source) -> list[dict[str, torch.Tensor]]:
    """Layer i's gate, up and down^T rows (per-row int4 arrays, neuron order): gate and up from the store,
    the down columns quantized from the source along the model dimension."""
    from formats.weights import layer_from_views

    g = store.groups[f"layer.{i}"]
    buf = torch.empty(g.nbytes, dtype=torch.uint8)
    with open(store.path, "rb", buffering=0) as f:
        f.seek(g.offset)
        if f.readinto(memoryview(buf.numpy())) != g.nbytes:
            raise CadenceError(f"{store.path} ended early; delete {store.dir} and convert again")
    w = layer_from_views(store, i, store.views(f"layer.{i}", buf))
    F = store.args.ffn_dim
    down = np.asarray(source.get(f"blk.{i}.ffn_down"), dtype=np.float32)
    if down.shape != (store.args.dim, F):
        raise CadenceError(f"{source.path}'s layer {i} FFN is {down.shape}, not the store's; convert it again")
    down_t, _ = linear.quantize_int4(torch.from_numpy(np.ascontiguousarray(down.T)), _group(store))
    rows = [w.gate_up.rows(0, F).per_row(), w.gate_up.rows(F, 2 * F).per_row(), down_t]
    # plain row-major strides: a [n, 1] array (a model under 256 wide) may come with a row stride of 16,
    # which records.pack cannot view as bytes
    return [{k: v.clone(memory_format=torch.contiguous_format) for k, v in r.items()} for r in rows]


def _group(store: WeightStore) -> int:
    return int(store.manifest.get("group_size", 32))


def write(
    store: WeightStore,
    chunk_neurons: int,
    source=None,
    orders: list[np.ndarray] | None = None,
    progress=None,
) -> Layout:
    """Write `bundles.bin` and the manifest's `bundles` section (the dense layout untouched). `source`: the
    model's source (default: the one the store was converted from); `orders`: per layer, the neuron at each
    position (default: identity); `progress()` is called after each layer."""
    check_store(store)
    if type(chunk_neurons) is not int or chunk_neurons < 1:
        raise CadenceError(f"a chunk holds at least one neuron; got {chunk_neurons}")
    a = store.args
    source = source or source_of(store)
    lay = Layout(
        a.dim,
        a.ffn_dim,
        a.n_layers,
        records.record_bytes(a.dim),
        chunk_neurons,
        "identity" if orders is None else "given",
        store.manifest.get("source", {}).get("sha256", ""),
    )
    tmp = store.dir / (FILE + ".partial")
    try:
        with open(tmp, "wb") as f:
            for i in range(a.n_layers):
                order = np.arange(a.ffn_dim) if orders is None else np.asarray(orders[i], dtype=np.int64)
                if order.shape != (a.ffn_dim,) or not np.array_equal(np.sort(order), np.arange(a.ffn_dim)):
                    raise CadenceError(f"layer {i}'s neuron order is not a permutation of its {a.ffn_dim} neurons")
                recs = records.pack(layer_rows(store, i, source), a.dim)[torch.from_numpy(order)]
                f.write(_layer_bytes(lay, recs, order))
                if progress:
                    progress()
            f.flush()
            os.fsync(f.fileno())  # on disk before it is named: and clean pages, which a reader's eviction drops
        os.replace(tmp, store.dir / FILE)
    finally:
        tmp.unlink(missing_ok=True)
    _write_section(store, lay)
    return lay


def _layer_bytes(lay: Layout, recs: torch.Tensor, order: np.ndarray) -> memoryview:
    """One layer's stretch of the file: its chunks, then its order."""
    out = np.zeros(lay.stride, dtype=np.uint8)
    packed = torch.zeros(lay.chunks * lay.chunk_neurons, lay.record, dtype=torch.uint8)
    packed[: lay.ffn_dim] = recs
    body = out[: lay.layer_bytes].reshape(lay.chunks, lay.chunk_bytes)
    body[:, : lay.chunk_neurons * lay.record] = packed.view(lay.chunks, -1).numpy()
    out[lay.layer_bytes : lay.layer_bytes + 4 * lay.ffn_dim] = order.astype(np.int32).view(np.uint8)
    return memoryview(out)


def _write_section(store: WeightStore, lay: Layout) -> None:
    """The manifest with its `bundles` section (every other entry as it was), replaced atomically."""
    path = store.dir / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["bundles"] = lay.to_dict()
    tmp = path.with_name("manifest.json.tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, path)
    store.manifest["bundles"] = manifest["bundles"]


def read_orders(store: WeightStore, lay: Layout) -> list[np.ndarray]:
    """Per layer, the neuron at each position; one sentence where one is not a permutation."""
    out = []
    with open(store.dir / FILE, "rb") as f:
        for i in range(lay.n_layers):
            f.seek(lay.order_at(i))
            order = np.frombuffer(f.read(4 * lay.ffn_dim), dtype=np.int32).astype(np.int64)
            if order.shape != (lay.ffn_dim,) or not np.array_equal(np.sort(order), np.arange(lay.ffn_dim)):
                raise CadenceError(
                    f"{store.dir / FILE} is damaged (layer {i}'s neuron order is not a permutation); {_again(store)}"
                )
            out.append(order)
    return out


def favoured_chunk_neurons(store: WeightStore, say=None, miss: float = 0.05) -> int:
    """The chunk size this machine's read curve favours for this model (each new token's ~5% of a layer's
    neurons missing from the window, the issue's measurement), measuring the curve on first need."""
    from flash.costmodel import best_chunk_neurons, machine_curve

    a = store.args
    return best_chunk_neurons(machine_curve(store.path, say), records.record_bytes(a.dim), a.ffn_dim, miss)
