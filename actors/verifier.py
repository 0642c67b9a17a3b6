"""The verifier actor: the target model scoring a whole token tree in one pass (speculative/verify.py)."""
from __future__ import annotations

import torch

from actors.base import Actor, ActorContext
from models.engine import load_store
from models.sampling import SamplingConfig
from speculative.draft import trials_from_wire
from speculative.tree import TokenTree
from speculative.verify import Verifier


class VerifierActor(Actor):
    role = "verifier"

    def __init__(self, init: dict, ctx: ActorContext):
        super().__init__(init, ctx)
        torch.set_num_threads(int(init.get("threads") or torch.get_num_threads()))
        with self.trace.span("load target", cat="setup"):
            self.lm = load_store(init["store"], init.get("name", ""))
        self.sampling = SamplingConfig(**init["sampling"])
        self.verifier = None

    def op_start(self, args, tensors):
        """Prefill the prompt; the first token."""
        self.verifier = Verifier(self.lm.model, self.sampling)
        first = self.verifier.start(list(args["prompt_ids"]), int(args["capacity"]))
        return {"token": first}

    def op_step(self, args, tensors):
        """A plain decode step on the root."""
        return {"token": self.verifier.step(int(args["root"]))}

    def op_verify(self, args, tensors):
        tree = TokenTree.from_lists(args)
        trials = None
        if "trials" in args:
            dists = self.tensor(tensors["dists"]) if "dists" in tensors else None
            trials = trials_from_wire(args["trials"], dists)
        v = self.verifier.verify_tree(tree, trials)
        return {"path": v.path, "next": v.next_token, "rows": v.rows}
