"""The verifier actor: the target model scoring a whole token tree in one pass (speculative/verify.py).

Resident mode (`start`, `step`, `verify`): every target layer is in this process, one op a job.
Job mode (`begin`, then `layer` / `dense` + `merge`, until `{"done": result}`), used under a memory
budget and with the sparse-attention worker: a job (`start`, `step` or `verify`) runs until it
needs something from outside and says so:
  {"need": "layer.7"}: a streamed group; the scheduler has the loader put it into an arena slot
      and hands it over with `layer`;
  {"need": "attn", ...}: a multi-token attention split with the sparse worker: this actor has put
      Q into the arena; the scheduler sends the worker its chunks and this actor `dense` (its own
      chunks) at once, then `merge` with the worker's chunk states.
  {"need": "cols", ...}: a linear layer split by output columns with the worker (--column-share):
      its input is in the arena's `xin` slot and its output goes to `x` (added to the residual) or
      `y`; the scheduler sends the worker its columns and this actor `cols` (its own) at once, then
      `cols_done` once both have written theirs.
"""
from __future__ import annotations

import torch

from actors.base import Actor, ActorContext
from models.engine import load_store
from models.linear import column_split
from models.sampling import SamplingConfig
from models.store import WeightStore
from models.transformer import Transformer
from models import kernels
from models.weights import StreamingWeights, weights_for
from speculative.draft import trials_from_wire
from speculative.tree import TokenTree
from speculative.verify import Verifier


class VerifierActor(Actor):
    role = "verifier"

    def __init__(self, init: dict, ctx: ActorContext):
        super().__init__(init, ctx)
        torch.set_num_threads(int(init.get("threads") or torch.get_num_threads()))
        self.streaming = init.get("resident") is not None
        with self.trace.span("load target", cat="setup"):
            if self.streaming:
                store = WeightStore(init["store"])
                self.weights = StreamingWeights(store, set(init["resident"]))
                self.model = Transformer(store.args, self.weights)
            else:
                self.model = load_store(init["store"], init.get("name", "")).model
                self.weights = self.model.weights
        self.worker = init.get("worker")  # {"share": dense share given to the sparse worker} or None
        self.model.split_attention = self.worker is not None
        self.model.column_share = float((self.worker or {}).get("columns", 0.0)) if self.model.fused else 0.0
        self.cols = None  # the linear being split by columns: (layer, name, linear, x, y, accumulate, n0)
        self.sampling = SamplingConfig(**init["sampling"])
        self.verifier = None
        self.job = None  # job mode: the job under way (a generator) and what it waits for
        self.need = None
        self.kind = None
        self.slots = {}  # job mode with the worker: arena tensors for Q and the worker's chunk states
        self.attn = None  # the attention being split: (layer, q, vis, chunk split, running state)
        self.split_vis = None  # (vis, k0, maxc) of the forward whose layers are being split: one per forward

    # -- resident ---------------------------------------------------------------------------

    def op_start(self, args, tensors):
        """Prefill the prompt; the first token."""
        self.verifier = Verifier(self.model, self._sampling(args), previous=self.verifier)
        token = self.verifier.start(list(args["prompt_ids"]), int(args["capacity"]))
        return {"token": token, "reused": self.verifier.reused}

    def _sampling(self, args) -> SamplingConfig:
        """A generation's own sampling (a server's request), or the run's."""
        return SamplingConfig(**args["sampling"]) if "sampling" in args else self.sampling

    def op_step(self, args, tensors):
        """A plain decode step on the root."""
        return {"token": self.verifier.step(int(args["root"]))}

    def op_verify(self, args, tensors):
        v = self.verifier.verify_tree(*self._tree(args, tensors))
        return {"path": v.path, "next": v.next_token, "rows": v.rows}

    def _tree(self, args, tensors):
        tree = TokenTree.from_lists(args)
        trials = None
        if "trials" in args:
            dists = self.tensor(tensors["dists"]) if "dists" in tensors else None
            trials = trials_from_wire(args["trials"], dists)
        return tree, trials

    # -- streaming --------------------------------------------------------------------------

    def op_begin(self, args, tensors):
        """Start a job: {"job": "start", prompt_ids, capacity} | {"job": "step", root} | {"job": "verify", ...tree}."""
        if self.job is not None:
            raise RuntimeError(f"a {self.kind} job is still waiting for {self.need}")
        kind = args["job"]
        self.slots = {k: self.tensor(v) for k, v in tensors.items() if k in ("q", "ch", "kv", "x", "xin", "y")}
        if all(k in self.slots for k in ("x", "xin", "y")):
            self.model.col_bufs = tuple(self.slots[k].view(torch.float32) for k in ("x", "xin", "y"))
        if kind == "start":
            self.verifier = Verifier(self.model, self._sampling(args), previous=self.verifier)
            job = self.verifier.start_steps(list(args["prompt_ids"]), int(args["capacity"]), self.slots.get("kv"))
        elif kind == "step":
            job = self.verifier.step_steps(int(args["root"]))
        elif kind == "verify":
            job = self.verifier.verify_steps(*self._tree(args, tensors))
        else:
            raise ValueError(f"unknown job {kind!r}; use start, step or verify")
        self.job, self.kind = job, kind
        return self._advance(next(job))

    def op_layer(self, args, tensors):
        """The streamed group the job waits for, in an arena slot (mapped, not copied)."""
        group = args["group"]
        if self.job is None or group != self._group(self.need):
            raise RuntimeError(f"layer {group} arrived but the verifier waits for {self._group(self.need)}")
        with self.trace.span(f"compute:{group}", cat="verify", args={"group": group}):
            w = self.weights.from_buffer(group, self.tensor(tensors["slot"]))
            try:
                need = self.job.send(w)
            except StopIteration as done:
                return self._done(done.value)
        return self._advance(need)  # resident layers after it count as their own work, not this group's

    def op_dense(self, args, tensors):
        """This unit's share of a split attention: the first dense chunks, folded while the worker works."""
        i, q, vis, c_split, _ = self.attn
        with self.trace.span(f"dense:layer.{i}", cat="attention", args={"chunks": c_split}):
            state = kernels.attn_dense(q, self.verifier.cache.k[i], self.verifier.cache.v[i], 0, c_split, self.model.scale)
        self.attn = (i, q, vis, c_split, state)
        return {}

    def op_merge(self, args, tensors):
        """Fold the worker's chunk states (in the `ch` slot) after ours, in order, and go on with the job."""
        i, q, vis, c_split, state = self.attn
        T, H, D = q.shape
        maxc = int(args["maxc"])
        ch = self.slots["ch"].view(torch.float32)[:T * H * maxc * (D + 2)].view(T, H, maxc, D + 2)
        o = kernels.attn_merge(state, ch, torch.tensor(args["nch"], dtype=torch.int32))
        self.attn = None
        return self._resume(o)

    def op_cols(self, args, tensors):
        """This unit's columns of the linear being split: [0, n0), written into the shared output."""
        i, name, lin, x, y, acc, n0 = self.cols
        with self.trace.span(f"cols:layer.{i}.{name}", cat="verify", args={"rows": x.shape[0], "cols": n0}):
            lin.matmul_cols(x, y, 0, n0, acc)
        return {}

    def op_cols_done(self, args, tensors):
        """Both units have written their columns: go on with the job."""
        self.cols = None
        return self._resume(None)

    def _resume(self, value):
        """Send the job what it waited for; on to its next need, or its end."""
        try:
            need = self.job.send(value)
        except StopIteration as done:
            return self._done(done.value)
        return self._advance(need)

    @staticmethod
    def _group(need) -> str:
        return need if isinstance(need, str) else f"layer.{need}"

    def _resident(self, need) -> bool:
        if not self.streaming:
            return not isinstance(need, tuple)
        return self.weights.is_resident(need)

    def _advance(self, need):
        """Feed resident layers until the job needs something from outside, or ends."""
        try:
            while self._resident(need):
                need = self.job.send(weights_for(self.weights, need))
        except StopIteration as done:
            return self._done(done.value)
        self.need = need
        if isinstance(need, tuple) and need[0] == "cols":
            _, i, name, lin, x, y, acc = need
            n0 = column_split(lin.n, self.model.column_share)
            self.cols = (i, name, lin, x, y, acc, n0)
            return {"need": "cols", "layer": i, "name": name, "T": x.shape[0], "acc": acc, "n0": n0}
        if isinstance(need, tuple):
            return self._split_attention(need)
        return {"need": self._group(need)}

    def _split_attention(self, need):
        _, i, q, vis = need
        T, H, D = q.shape
        first = self.split_vis is None or self.split_vis[0] is not vis  # every layer of a forward shares its vis
        if first:
            c_star = vis.n_shared // kernels.CHUNK  # chunks made of shared context only
            k0 = int(c_star * (1.0 - float(self.worker["share"]))) * kernels.CHUNK  # ours: keys [0, k0); the worker's: the rest
            self.split_vis = (vis, k0, kernels.max_chunks(vis.n_shared, vis.ptr, k0))
        _, k0, maxc = self.split_vis
        self.slots["q"].view(torch.float32)[:q.numel()].copy_(q.flatten())
        self.attn = (i, q, vis, k0 // kernels.CHUNK, None)
        need = {"need": "attn", "layer": i, "T": T, "n_shared": vis.n_shared, "k0": k0, "maxc": maxc, "scale": self.model.scale}
        if first:  # the tree's index travels once per forward; the worker keeps it for the other layers
            need.update(ptr=vis.ptr.tolist(), idx=vis.idx.tolist())
        return need

    def _done(self, value):
        kind, self.job, self.need = self.kind, None, None
        if kind == "verify":
            return {"done": {"path": value.path, "next": value.next_token, "rows": value.rows}}
        return {"done": {"token": value, "reused": self.verifier.reused if kind == "start" else 0}}
