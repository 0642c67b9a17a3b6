"""The bundled FFN layout (LLM in a flash §3.2) beside a weight store: `bundles.bin` and a `bundles` section
in the store's manifest. The dense layout is left as it is, byte for byte.

Neuron i of a layer is one record: its gate row, its up row and its down column (a row of down^T), each
quantized along the model dimension in the store's format, so one read brings everything the neuron needs.
The gate and up rows are the dense store's own rows (the same codes and scales); the down column is
quantized afresh from the source, along the model dimension. A layer's records follow a neuron order
(identity, or co-activation: neurons often active together side by side) and are grouped `chunk_neurons`
to a chunk, each chunk padded to whole 4 KiB blocks: the unit of a direct read.

Record of a neuron, int4 (K = model dim, G = K/32 groups, S = ceil(K/256) super-blocks; gate, up, down):
    codes [3][K/2]  per group of 32: byte b holds code b (low nibble) and code 16 + b (high nibble)
    sc [3][G] u8, mn [3][G] u8, s [3][S] f16, m [3][S] f16     w = code * s * sc - m * mn (models/linear.py)
int8: codes [3][K] i8, scale [3] f32 (w = code * scale). Records are padded to 16 bytes.
Each layer also stores its order (int32 [F]: position -> neuron) after its chunks.
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
from models.flash.costmodel import aligned
from models.store import WeightStore

FILE = "bundles.bin"
FORMATS = ("int4", "int8")
VERSION = 1


def record_bytes(fmt: str, dim: int) -> int:
    if fmt == "int4":
        n = 3 * (dim // 2 + 2 * (dim // 32) + 4 * -(-dim // 256))
    else:
        n = 3 * dim + 12
    return -(-n // 16) * 16


def _nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Codes [n, K] (0..15) -> [n, K/2]: per group of 32, low nibbles codes 0..15, high nibbles 16..31."""
    g = codes.view(codes.shape[0], -1, 2, 16)
    return (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(codes.shape[0], -1)


def _unnibble(b: torch.Tensor) -> torch.Tensor:
    g = b.view(b.shape[0], -1, 1, 16)
    return torch.cat([g & 15, g >> 4], dim=2).reshape(b.shape[0], -1)


def pack_records(fmt: str, rows: list[dict[str, torch.Tensor]], dim: int) -> torch.Tensor:
    """Three per-row arrays (gate, up, down^T; `QuantLinear.per_row` form) of n neurons -> records [n, R] uint8."""
    n = rows[0]["q"].shape[0]
    raw = lambda t: t.contiguous().view(torch.uint8).reshape(n, -1)
    if fmt == "int4":
        parts = [_nibbles(r["q"]) for r in rows] + [raw(r[k]) for k in ("sc", "mn", "s", "m") for r in rows]
    else:
        parts = [raw(r["q"]) for r in rows] + [raw(r["scale"].float().reshape(n, 1)) for r in rows]
    body = torch.cat(parts, dim=1)
    out = torch.zeros(n, record_bytes(fmt, dim), dtype=torch.uint8)
    out[:, : body.shape[1]] = body
    return out


def unpack_records(fmt: str, rec: torch.Tensor, dim: int) -> list[dict[str, torch.Tensor]]:
    """Records [n, R] -> per-row arrays of gate, up and down^T (the inverse of `pack_records`)."""
    n, at, out = rec.shape[0], 0, [{}, {}, {}]

    def take(nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        nonlocal at
        t = rec[:, at : at + nbytes].contiguous().view(dtype)
        at += nbytes
        return t

    if fmt == "int4":
        g, s = dim // 32, -(-dim // 256)
        for r in out:
            r["q"] = _unnibble(take(dim // 2, torch.uint8))
        for key, nbytes, dtype in (("sc", g, torch.uint8), ("mn", g, torch.uint8), ("s", 2 * s, torch.float16),
                                   ("m", 2 * s, torch.float16)):
            for r in out:
                r[key] = take(nbytes, dtype)
    else:
        for r in out:
            r["q"] = take(dim, torch.int8)
        for r in out:
            r["scale"] = take(4, torch.float32).reshape(n)
    return out


def dequantize_rows(fmt: str, rows: dict[str, torch.Tensor], dim: int) -> torch.Tensor:
    """Per-row arrays -> fp32 [n, dim], by the store's own arithmetic (models/linear.py)."""
    arrays, meta = _tiled(fmt, rows)
    return linear.decode(fmt, arrays, meta).dequantized()


def _tiled(fmt: str, rows: dict[str, torch.Tensor]):
    from models import tiles

    return tiles.pack(fmt, rows), {"n": rows["q"].shape[0], "tile": tiles.TILE}


@dataclass(frozen=True)
class Layout:
    """The `bundles` section of a store's manifest."""

    fmt: str
    dim: int
    ffn_dim: int
    record: int  # bytes per neuron
    chunk_neurons: int
    chunk_bytes: int  # a chunk on disk: chunk_neurons records, padded to whole 4 KiB blocks
    layers: tuple[tuple[int, int], ...]  # per layer: (offset of its first chunk, offset of its order)
    order: str  # "identity" or "coactivation"
    file_bytes: int

    @property
    def chunks(self) -> int:
        return -(-self.ffn_dim // self.chunk_neurons)

    def to_dict(self) -> dict:
        return {"version": VERSION, "file": FILE, "format": self.fmt, "dim": self.dim, "ffn_dim": self.ffn_dim,
                "record_bytes": self.record, "chunk_neurons": self.chunk_neurons, "chunk_bytes": self.chunk_bytes,
                "layers": [list(x) for x in self.layers], "order": self.order, "file_bytes": self.file_bytes}

    @classmethod
    def of(cls, store: WeightStore) -> "Layout":
        """The store's bundle layout, checked against its file; one sentence when missing or damaged."""
        again = f"write them again with `launch models bundle {store.dir}`"
        d = store.manifest.get("bundles")
        if d is None:
            raise CadenceError(f"{store.dir} has no FFN bundles; write them with `launch models bundle {store.dir}`")
        try:
            if d["version"] != VERSION:
                raise ValueError(f"version {d['version']}, this cadence reads {VERSION}")
            lay = cls(d["format"], int(d["dim"]), int(d["ffn_dim"]), int(d["record_bytes"]), int(d["chunk_neurons"]),
                      int(d["chunk_bytes"]), tuple((int(a), int(b)) for a, b in d["layers"]), d["order"],
                      int(d["file_bytes"]))
        except (KeyError, TypeError, ValueError) as e:
            raise CadenceError(f"the bundles section of {store.dir / 'manifest.json'} is damaged ({e}); {again}") from None
        path = store.dir / FILE
        size = path.stat().st_size if path.is_file() else None
        if size != lay.file_bytes or len(lay.layers) != store.args.n_layers:
            raise CadenceError(f"{path} is missing or truncated ({size} bytes, the manifest says {lay.file_bytes}); "
                               f"{again}")
        return lay


def layer_rows(store: WeightStore, i: int, source) -> list[dict[str, torch.Tensor]]:
    """Layer i's gate, up and down^T rows in the store's format (per-row arrays, neuron order)."""
    from models.weights import layer_from_views

    g = store.groups[f"layer.{i}"]
    buf = torch.empty(g.nbytes, dtype=torch.uint8)
    with open(store.path, "rb", buffering=0) as f:
        f.seek(g.offset)
        f.readinto(memoryview(buf.numpy()))
    w = layer_from_views(store, i, store.views(f"layer.{i}", buf))
    F = w.down.k
    down_t = torch.from_numpy(np.ascontiguousarray(source.get(f"blk.{i}.ffn_down").T)).float()
    if store.format == "int4":
        down, _ = linear.quantize_int4(down_t, int(store.manifest.get("group_size", 32)))
    else:
        down, _ = linear.quantize_int8(down_t)
    return [w.gate_up.rows(0, F).per_row(), w.gate_up.rows(F, 2 * F).per_row(), down]


def write(store: WeightStore, source, chunk_neurons: int, orders: list[np.ndarray] | None = None,
          progress=None) -> Layout:
    """Write `bundles.bin` and the manifest's `bundles` section (the dense layout untouched). `orders`: per
    layer, the neuron at each position (default: identity)."""
    a, fmt = store.args, store.format
    if fmt not in FORMATS:
        raise CadenceError(f"FFN bundles are written for int4 and int8 stores; {store.dir} is {fmt}")
    if a.moe:
        raise CadenceError(f"{store.dir} holds a mixture of experts: FFN bundles are for dense FFN models")
    if chunk_neurons < 1:
        raise CadenceError(f"a chunk holds at least one neuron; got {chunk_neurons}")
    rec = record_bytes(fmt, a.dim)
    cbytes = aligned(chunk_neurons * rec)
    nchunks = -(-a.ffn_dim // chunk_neurons)
    tmp = store.dir / (FILE + ".partial")
    layers, pos = [], 0
    with open(tmp, "wb") as f:
        for i in range(a.n_layers):
            order = np.arange(a.ffn_dim) if orders is None else np.asarray(orders[i])
            if sorted(order.tolist()) != list(range(a.ffn_dim)):
                raise ValueError(f"layer {i}'s order is not a permutation of its {a.ffn_dim} neurons")
            recs = pack_records(fmt, layer_rows(store, i, source), a.dim)[torch.from_numpy(order.astype(np.int64))]
            body = torch.zeros(nchunks, cbytes, dtype=torch.uint8)
            flat = torch.zeros(nchunks * chunk_neurons, rec, dtype=torch.uint8)
            flat[: a.ffn_dim] = recs
            body[:, : chunk_neurons * rec] = flat.view(nchunks, -1)
            start = pos
            f.write(body.numpy().tobytes())
            pos += body.numel()
            order_at = pos
            f.write(np.ascontiguousarray(order, dtype=np.int32).tobytes())
            pos += 4 * a.ffn_dim
            f.write(b"\0" * (aligned(pos) - pos))
            pos = aligned(pos)
            layers.append((start, order_at))
            if progress:
                progress()
    lay = Layout(fmt, a.dim, a.ffn_dim, rec, chunk_neurons, cbytes, tuple(layers),
                 "identity" if orders is None else "coactivation", pos)
    os.replace(tmp, store.dir / FILE)
    _write_section(store, lay)
    return lay


def _write_section(store: WeightStore, lay: Layout) -> None:
    path = store.dir / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["bundles"] = lay.to_dict()
    tmp = path.with_name("manifest.json.tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, path)
    store.manifest["bundles"] = manifest["bundles"]


def read_order(store: WeightStore, lay: Layout, i: int) -> np.ndarray:
    with open(store.dir / FILE, "rb") as f:
        f.seek(lay.layers[i][1])
        order = np.frombuffer(f.read(4 * lay.ffn_dim), dtype=np.int32).copy()
    if order.shape[0] != lay.ffn_dim or sorted(order.tolist()) != list(range(lay.ffn_dim)):
        raise CadenceError(f"{store.dir / FILE} is damaged (layer {i}'s neuron order is not a permutation); write "
                           f"the bundles again with `launch models bundle {store.dir}`")
    return order
