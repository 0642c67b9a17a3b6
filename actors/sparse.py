"""The sparse-attention actor (Ghidorah): the part of tree attention a second unit takes.

In a verification, each row's attention is cut into chunks of 32 keys (models/csrc/attention.cpp):
the verifier folds the chunks of the shared context (the dense part: tree queries x the KV cache)
and this actor computes the chunk states of the rest (the sparse part: the context's last partial
chunk and the row's own ancestors in the tree, only those pairs), plus, by the partition ratio, a
range of the dense chunks. It reads Q and the KV cache where the verifier keeps them, in the
shared-memory arena, and writes its chunk states there; the verifier merges them in chunk order
with the online-softmax rescaling, which gives bit for bit the result of one unit doing it all.
It gets one request per verifier job (`serve`) and follows the verifier's plans layer by layer
through the arena's sync area (actors/executor.py), with no message in between.

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
from actors.executor import ACCUMULATE, LINEARS, serve
from actors.syncarea import Clock, SyncArea
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
        self.cache = None  # the verifier's KV cache, mapped at each prompt's start
        self.area = None
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

    def op_serve(self, args, tensors):
        """Serve one verifier job's split (actors/executor.py): {"job": id, "rows", "timeout_s"}, and at a
        prompt's start "capacity" with the `kv` slot (the verifier's KV cache, mapped: no copy); the slots
        sync, q, ch, and with a column share x, xin, y. Replies once the verifier has ended the job."""
        if "kv" in tensors:
            self.cache = KVCache(self.args, int(args["capacity"]), storage=self.tensor(tensors["kv"]))
        if self.cache is None:
            raise RuntimeError("no KV cache bound: a prompt's first job (start) brings it")
        slots = {k: self.tensor(v) for k, v in tensors.items()}
        self.area = SyncArea(slots["sync"], int(args["rows"]))
        self.q, self.ch = slots["q"].view(torch.float32), slots["ch"].view(torch.float32)
        self.bufs = {k: slots[k].view(torch.float32) for k in ("x", "xin", "y") if k in slots}
        clock = Clock("the verifier", float(args["timeout_s"]), self.interrupted, self.beat, self.ctx.heartbeat_s)
        return {"forwards": serve(self.area, int(args["job"]), self.args.n_layers, clock, self._attend, self._columns)}

    def _attend(self, plan, i: int):
        """Chunk states of every row from key k0 on, for layer i, into the `ch` slot; their counts into the sync area."""
        T, H, D = plan.T, self.args.n_heads, self.args.head_dim
        q = self.q[:T * H * D].view(T, H, D)
        with self.trace.span(f"sparse:layer.{i}", cat="attention", args={"rows": T, "k0": plan.k0}):
            _, nch = kernels.attn_chunks(q, self.cache.k[i], self.cache.v[i], plan.n_shared, plan.ptr, plan.idx,
                                         plan.k0, plan.scale, plan.maxc, out=self.ch)
        self.area.nch[:T] = nch.numpy()

    def _columns(self, plan, i: int, name: str):
        """Columns [n0, N) of one linear layer of the target, n0 as the plan split it: input from `xin`,
        into (or added to) `x` (the residual stream) or `y`."""
        if self.layers is None or "xin" not in self.bufs:
            raise RuntimeError("this worker was started without a column share; start it with --column-share")
        lin, T, acc = getattr(self.layers[i], name), plan.T, ACCUMULATE[name]
        n0 = plan.n0[[n for n, _ in LINEARS].index(name)]
        x = self.bufs["xin"][:T * lin.k].view(T, lin.k)
        y = self.bufs["x" if acc else "y"][:T * lin.n].view(T, lin.n)
        with self.trace.span(f"cols:layer.{i}.{name}", cat="linear", args={"rows": T, "cols": lin.n - n0}):
            lin.matmul_cols(x, y, n0, lin.n, acc)
