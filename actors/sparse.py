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
from actors.calls import record
from actors.starts import SparseStart
from actors.executor import WorkerShare
from actors.syncarea import Clock, SyncArea
from models import kernels
from models.args import ModelArgs
from formats.store import WeightStore
from models.kvcache import KVCache
from formats.weights import layer_from_views


class SparseAttnActor(Actor):
    role = "sparse"

    def __init__(self, init: dict, ctx: ActorContext):
        super().__init__(init, ctx)
        start = record(SparseStart, init, "the sparse worker's start")
        torch.set_num_threads(start.threads)
        self.args = ModelArgs.from_dict(start.model)
        self.cache = None  # the verifier's KV cache, mapped at each prompt's start
        self.kv_dtype = start.kv_dtype  # its keys' and values' (--kv-dtype)
        self.layers = self._map_layers(start.store) if start.columns > 0 else None
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
            layers.append(layer_from_views(store, i, store.views(g.name, buf[g.offset : g.offset + g.nbytes])))
        return layers

    def op_serve(self, job: int, rows: int, timeout_s: float, tensors: dict, capacity: int | None = None):
        """Serve the split of verifier job `job` (actors/executor.py) until the verifier ends it, waiting at most
        `timeout_s` for each of its steps; `rows`: the most rows a forward has. At a prompt's start the `kv` slot
        (the verifier's KV cache, `capacity` rows, mapped: no copy); the slots sync, q, ch, and with a column
        share x, xin, y. Replies once the verifier has ended the job."""
        if "kv" in tensors:
            self.cache = KVCache(self.args, capacity, storage=self.tensor(tensors["kv"]), dtype=self.kv_dtype)
        if self.cache is None:
            raise RuntimeError("no KV cache bound: a prompt's first job (start) brings it")
        slots = {k: self.tensor(v) for k, v in tensors.items()}
        share = WorkerShare(self.args, self.cache, self.layers, SyncArea(slots["sync"], rows), slots, self.trace)
        clock = Clock("the verifier", timeout_s, self.interrupted, self.beat, self.ctx.heartbeat_s)
        return {"forwards": share.serve(job, clock)}
