"""The sparse-attention actor (Ghidorah): the part of tree attention a second unit takes.

In a verification, each row's attention is cut into chunks of 32 keys (models/csrc/attention.cpp):
the verifier folds the chunks of the shared context (the dense part: tree queries x the KV cache)
and this actor computes the chunk states of the rest (the sparse part: the context's last partial
chunk and the row's own ancestors in the tree, only those pairs), plus, by the partition ratio, a
range of the dense chunks. It reads Q and the KV cache where the verifier keeps them, in the
shared-memory arena, and writes its chunk states there; the verifier merges them in chunk order
with the online-softmax rescaling, which gives bit for bit the result of one unit doing it all.

With a column share (`--column-share`), it also takes the last columns of every linear layer of the
target in multi-token passes: it maps the target's weight store read-only (the page cache holds
the rows it reads, once for the whole machine), reads the layer's input from the arena and writes
its columns into the shared output, next to the verifier's.
"""
from __future__ import annotations

import mmap
import warnings

import torch

from actors.base import Actor, ActorContext
from models import kernels
from models.config import ModelArgs
from models.store import WeightStore
from models.transformer import KVCache
from models.weights import layer_from_views


class SparseAttnActor(Actor):
    role = "sparse"

    def __init__(self, init: dict, ctx: ActorContext):
        super().__init__(init, ctx)
        torch.set_num_threads(int(init.get("threads") or 1))
        self.args = ModelArgs.from_dict(init["model"])
        self.cache = None
        self.vis = None  # (ptr, idx) of the forward being verified: sent with its first layer only
        self.layers = self._map_layers(init["store"]) if float(init.get("columns") or 0.0) > 0 else None
        kernels.lib()  # build or load the kernels now, not during the first verification

    def _map_layers(self, store_dir: str) -> list:
        """The target's layers as views of its weights file mapped read-only: nothing is read until used."""
        store = WeightStore(store_dir)
        with open(store.path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        with warnings.catch_warnings():  # read-only by design: these weights are never written
            warnings.simplefilter("ignore", UserWarning)
            buf = torch.frombuffer(self._map, dtype=torch.uint8)
        layers = []
        for i in range(store.args.n_layers):
            g = store.groups[f"layer.{i}"]
            layers.append(layer_from_views(store, i, store.views(g.name, buf[g.offset:g.offset + g.nbytes])))
        return layers

    def op_bind(self, args, tensors):
        """Map the verifier's KV cache for this generation (no copy)."""
        self.cache = KVCache(self.args, int(args["capacity"]), storage=self.tensor(tensors["kv"]))
        return {}

    def op_attend(self, args, tensors):
        """Chunk states of every row from key index k0 on, for one layer, into the `out` slot."""
        i = int(args["layer"])
        q = self.tensor(tensors["q"])
        T, H, D = int(args["T"]), self.args.n_heads, self.args.head_dim
        q = q.view(torch.float32)[:T * H * D].view(T, H, D)
        if "ptr" in args:
            self.vis = (torch.tensor(args["ptr"], dtype=torch.int32), torch.tensor(args["idx"], dtype=torch.int32))
        ptr, idx = self.vis
        with self.trace.span(f"sparse:layer.{i}", cat="attention", args={"rows": T, "k0": args["k0"]}):
            _, nch = kernels.attn_chunks(q, self.cache.k[i], self.cache.v[i], int(args["n_shared"]), ptr, idx,
                                         int(args["k0"]), float(args["scale"]), int(args["maxc"]),
                                         out=self.tensor(tensors["out"]))
        return {"nch": nch.tolist()}

    def op_cols(self, args, tensors):
        """Columns [n0, N) of one linear layer of the target, n0 as the verifier split it: input from
        `xin`, into (or added to) `out`."""
        if self.layers is None:
            raise RuntimeError("this worker was started without a column share; start it with --column-share")
        i, name, T, n0 = int(args["layer"]), args["name"], int(args["T"]), int(args["n0"])
        lin = getattr(self.layers[i], name)
        x = self.tensor(tensors["xin"]).view(torch.float32)[:T * lin.k].view(T, lin.k)
        y = self.tensor(tensors["out"]).view(torch.float32)[:T * lin.n].view(T, lin.n)
        with self.trace.span(f"cols:layer.{i}.{name}", cat="linear", args={"rows": T, "cols": lin.n - n0}):
            lin.matmul_cols(x, y, n0, lin.n, bool(args["acc"]))
        return {}
