"""The verifier actor: the target model scoring a whole token tree in one pass (speculative/verify.py).

Resident mode (`start`, `step`, `verify`): every target layer is in this process. Streaming mode
(`begin`, `layer`), under a memory budget: only the plan's resident groups are here; a job
(`start`, `step` or `verify`) runs until it needs a streamed layer and answers `{"need": group}`;
the scheduler has the loader put that group into an arena slot and hands it over with `layer`;
the reply is the next need, or `{"done": result}`.
"""
from __future__ import annotations

import torch

from actors.base import Actor, ActorContext
from models.engine import load_store
from models.sampling import SamplingConfig
from models.store import WeightStore
from models.transformer import Transformer
from models.weights import StreamingWeights
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
        self.sampling = SamplingConfig(**init["sampling"])
        self.verifier = None
        self.job = None  # streaming: the job under way (a generator) and what it waits for
        self.need = None
        self.kind = None

    # -- resident ---------------------------------------------------------------------------

    def op_start(self, args, tensors):
        """Prefill the prompt; the first token."""
        self.verifier = Verifier(self.model, self.sampling)
        return {"token": self.verifier.start(list(args["prompt_ids"]), int(args["capacity"]))}

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
        if kind == "start":
            self.verifier = Verifier(self.model, self.sampling)
            job = self.verifier.start_steps(list(args["prompt_ids"]), int(args["capacity"]))
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
        return self._advance(need)

    @staticmethod
    def _group(need) -> str:
        return "head" if need == "head" else f"layer.{need}"

    def _advance(self, need):
        """Feed resident layers until the job needs a streamed one or ends."""
        try:
            while self.weights.is_resident(need):
                need = self.job.send(self.weights.head if need == "head" else self.weights.layer(need))
        except StopIteration as done:
            return self._done(done.value)
        self.need = need
        return {"need": self._group(need)}

    def _done(self, value):
        kind, self.job, self.need = self.kind, None, None
        if kind == "verify":
            return {"done": {"path": value.path, "next": value.next_token, "rows": value.rows}}
        return {"done": {"token": value}}
