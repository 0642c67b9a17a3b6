"""The sparse-attention actor (Ghidorah): the part of tree attention a second unit takes.

In a verification, each row's attention is cut into chunks of 32 keys (models/csrc/attention.cpp):
the verifier folds the chunks of the shared context (the dense part: tree queries x the KV cache)
and this actor computes the chunk states of the rest (the sparse part: the context's last partial
chunk and the row's own ancestors in the tree, only those pairs), plus, by the partition ratio, a
range of the dense chunks. It reads Q and the KV cache where the verifier keeps them, in the
shared-memory arena, and writes its chunk states there; the verifier merges them in chunk order
with the online-softmax rescaling, which gives bit for bit the result of one unit doing it all.
"""
from __future__ import annotations

import torch

from actors.base import Actor, ActorContext
from models import kernels
from models.config import ModelArgs
from models.transformer import KVCache


class SparseAttnActor(Actor):
    role = "sparse"

    def __init__(self, init: dict, ctx: ActorContext):
        super().__init__(init, ctx)
        torch.set_num_threads(int(init.get("threads") or 1))
        self.args = ModelArgs.from_dict(init["model"])
        self.cache = None
        self.vis = None  # (ptr, idx) of the forward being verified: sent with its first layer only
        kernels.lib()  # build or load the kernels now, not during the first verification

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
