"""Weight providers: where the engine gets each layer's weights from.

The engine asks `provider.layer(i)` right before it computes layer i, so a provider may hold
every layer in RAM (`ResidentWeights`) or hand layers in as a loader brings them into shared
memory (the streaming provider of the memory-wall pipeline).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from models import linear
from models.config import ModelArgs
from models.linear import Linear
from models.store import WeightStore


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    qkv: Linear
    attn_out: Linear
    ffn_norm: torch.Tensor
    gate_up: Linear
    down: Linear


@dataclass
class HeadWeights:
    norm: torch.Tensor
    out: Linear


def _linear(store: WeightStore, name: str, arrays: dict[str, torch.Tensor], bias=None) -> Linear:
    entry = store.tensors[name]
    meta = {k: v for k, v in entry.items() if k not in ("format", "arrays")}
    return linear.decode(entry["format"], arrays, meta, bias)


def layer_from_views(store: WeightStore, i: int, views: dict[str, dict[str, torch.Tensor]]) -> LayerWeights:
    b = f"blk.{i}"
    bias = views.get(f"{b}.attn_qkv_bias", {}).get("w")
    return LayerWeights(
        attn_norm=views[f"{b}.attn_norm"]["w"],
        qkv=_linear(store, f"{b}.attn_qkv", views[f"{b}.attn_qkv"], bias),
        attn_out=_linear(store, f"{b}.attn_out", views[f"{b}.attn_out"]),
        ffn_norm=views[f"{b}.ffn_norm"]["w"],
        gate_up=_linear(store, f"{b}.ffn_gate_up", views[f"{b}.ffn_gate_up"]),
        down=_linear(store, f"{b}.ffn_down", views[f"{b}.ffn_down"]),
    )


def head_from_views(store: WeightStore, views: dict, embed: torch.Tensor) -> HeadWeights:
    if "head" in views:
        out = _linear(store, "head", views["head"])
    else:  # tied, dense format: the embedding matrix is the head
        out = linear.DenseLinear(embed)
    return HeadWeights(norm=views["out_norm"]["w"], out=out)


class ResidentWeights:
    """Every layer in RAM: the whole weights file read into one buffer, arrays viewed out of it."""

    def __init__(self, store: WeightStore, device: str = "cpu"):
        self.store = store
        self.args: ModelArgs = store.args
        buf = store.read_all()
        if device != "cpu":
            buf = buf.to(device)

        def group(name):
            g = store.groups[name]
            return store.views(name, buf[g.offset:g.offset + g.nbytes])

        self.buffer = buf
        self.embed = group("embed")["embed"]["w"]
        self.layers = [layer_from_views(store, i, group(f"layer.{i}")) for i in range(self.args.n_layers)]
        self.head = head_from_views(store, group("head"), self.embed)

    def layer(self, i: int) -> LayerWeights:
        return self.layers[i]

    def nbytes(self) -> int:
        return self.buffer.numel()


class TensorWeights:
    """Weights from float tensors in memory, by canonical name (tests, tiny models), in any format."""

    def __init__(self, args: ModelArgs, tensors: dict[str, torch.Tensor], fmt: str = "fp32", group_size: int = 32):
        self.args = args
        enc = lambda name: linear.decode(fmt, *linear.encode(tensors[name], fmt, group_size))
        bias = lambda i: tensors.get(f"blk.{i}.attn_qkv_bias")
        self.embed = tensors["embed"].to(linear.float_dtype(fmt))
        self.layers = [
            LayerWeights(
                attn_norm=tensors[f"blk.{i}.attn_norm"].float(),
                qkv=linear.decode(fmt, *linear.encode(tensors[f"blk.{i}.attn_qkv"], fmt, group_size), bias(i)),
                attn_out=enc(f"blk.{i}.attn_out"),
                ffn_norm=tensors[f"blk.{i}.ffn_norm"].float(),
                gate_up=enc(f"blk.{i}.ffn_gate_up"),
                down=enc(f"blk.{i}.ffn_down"),
            )
            for i in range(args.n_layers)
        ]
        head = tensors.get("head", tensors["embed"] if args.tied_embeddings else None)
        self.head = HeadWeights(norm=tensors["out_norm"].float(), out=linear.decode(fmt, *linear.encode(head, fmt, group_size)))

    def layer(self, i: int) -> LayerWeights:
        return self.layers[i]


def random_tensors(args: ModelArgs, seed: int = 0, scale: float = 0.5) -> dict[str, torch.Tensor]:
    """Random float weights of a model shape: a tiny model for tests, no files involved."""
    from models.source import canonical_names

    g = torch.Generator().manual_seed(seed)
    shapes = {"embed": (args.vocab_size, args.dim), "out_norm": (args.dim,), "head": (args.vocab_size, args.dim)}
    out = {}
    for _, name in canonical_names(args):
        part = name.rsplit(".", 1)[-1]
        shape = shapes.get(name) or {
            "attn_norm": (args.dim,), "ffn_norm": (args.dim,), "attn_qkv": (args.q_dim + 2 * args.kv_dim, args.dim),
            "attn_qkv_bias": (args.q_dim + 2 * args.kv_dim,), "attn_out": (args.dim, args.q_dim),
            "ffn_gate_up": (2 * args.ffn_dim, args.dim), "ffn_down": (args.dim, args.ffn_dim)}[part]
        if part.endswith("norm"):
            out[name] = 1.0 + 0.1 * torch.randn(shape, generator=g)
        else:
            fan_in = shape[-1] if len(shape) > 1 else 1
            out[name] = torch.randn(shape, generator=g) * (scale / fan_in ** 0.5 if len(shape) > 1 else 0.1)
    return out


class EmbeddingRows:
    """The embedding table left on disk: `rows[tokens]` reads just those rows from the store file.

    A 152k-token vocabulary is a large share of a small model's bytes, and a decode step needs a
    handful of its rows; under a memory budget they are read when needed (buffered: a few KiB).
    """

    def __init__(self, store: WeightStore):
        a = store.tensors["embed"]["arrays"]["w"]
        self.offset, self.shape, self.dtype = a["offset"], a["shape"], a["dtype"]
        self.row_bytes = a["nbytes"] // self.shape[0]
        self.fd = os.open(store.path, os.O_RDONLY)

    def __getitem__(self, tokens: torch.Tensor) -> torch.Tensor:
        from models.store import DTYPES

        ids = tokens.flatten().tolist()
        buf = bytearray(self.row_bytes * len(ids))
        for i, t in enumerate(ids):
            if not 0 <= t < self.shape[0]:
                raise IndexError(f"token id {t} is outside the vocabulary of {self.shape[0]}")
            buf[i * self.row_bytes:(i + 1) * self.row_bytes] = os.pread(self.fd, self.row_bytes, self.offset + t * self.row_bytes)
        return torch.frombuffer(buf, dtype=DTYPES[self.dtype]).view(len(ids), self.shape[1])

    def close(self):
        os.close(self.fd)


class StreamingWeights:
    """Some groups resident (read once), the others handed in as views of arena slots per forward.

    `layer(i)` / `head` give the resident ones; `from_buffer(group, buf)` maps a streamed group
    that the loader put into a slot, with no copy. The embedding stays on disk (`EmbeddingRows`).
    """

    def __init__(self, store: WeightStore, resident: set[str], head_rows: int | None = None):
        """`head_rows`: keep only that many rows of the output head (the lowest token ids): a draft
        that proposes only frequent tokens (FR-Spec), for a fraction of the head's memory."""
        self.store, self.args = store, store.args
        self.resident_groups = set(resident)
        self.embed = EmbeddingRows(store)
        self.layers: dict[int, LayerWeights] = {}
        self.head: HeadWeights | None = None
        self.buffers = {}
        with open(store.path, "rb", buffering=0) as f:
            if head_rows is not None and head_rows < self.args.vocab_size and "head" in resident:
                resident = resident - {"head"}
                self.head = _read_head_rows(store, f, head_rows, self.buffers)
            for name in sorted(resident - {"embed"}, key=lambda g: store.groups[g].offset):
                g = store.groups[name]
                buf = torch.empty(g.nbytes, dtype=torch.uint8)
                f.seek(g.offset)
                f.readinto(memoryview(buf.numpy()))
                self.buffers[name] = buf
                self._install(name, buf)

    def _install(self, name: str, buf: torch.Tensor):
        w = self.from_buffer(name, buf)
        if name == "head":
            self.head = w
        else:
            self.layers[int(name.split(".")[1])] = w

    def from_buffer(self, name: str, buf: torch.Tensor):
        views = self.store.views(name, buf)
        if name == "head":
            return head_from_views(self.store, views, None)
        return layer_from_views(self.store, int(name.split(".")[1]), views)

    def layer(self, i: int) -> LayerWeights:
        return self.layers[i]

    def is_resident(self, need) -> bool:
        return (need == "head" and self.head is not None) or need in self.layers

    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers.values())


class PaddedHead:
    """The first `n` logits from a head of `n` rows, the rest -inf: a draft that never proposes
    the rarer tokens, and whose distributions still span the whole vocabulary."""

    def __init__(self, out: linear.Linear, vocab: int):
        self.out, self.vocab = out, vocab

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.out(x)
        full = torch.full((*y.shape[:-1], self.vocab), float("-inf"), dtype=y.dtype, device=y.device)
        full[..., :y.shape[-1]] = y
        return full


def _read_head_rows(store: WeightStore, f, rows: int, buffers: dict) -> HeadWeights:
    from models.store import DTYPES

    views: dict[str, dict[str, torch.Tensor]] = {}
    for name, key, a, nbytes in store.head_arrays(rows):
        buf = torch.empty(nbytes, dtype=torch.uint8)
        f.seek(a["offset"])
        f.readinto(memoryview(buf.numpy()))
        buffers[f"head:{name}.{key}"] = buf
        shape = [rows, *a["shape"][1:]] if nbytes != a["nbytes"] else a["shape"]
        views.setdefault(name, {})[key] = buf.view(DTYPES[a["dtype"]]).view(shape)
    head = head_from_views(store, views, None)
    return HeadWeights(norm=head.norm, out=PaddedHead(head.out, store.args.vocab_size))


def drive(steps, weights):
    """Run a `Transformer.forward_steps`-style generator to the end with weights from `weights`."""
    need = next(steps)
    try:
        while True:
            need = steps.send(weights.head if need == "head" else weights.layer(need))
    except StopIteration as done:
        return done.value
