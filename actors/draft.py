"""The draft actor: the small model, resident, growing token trees (speculative/draft.py)."""
from __future__ import annotations

import torch

from actors.base import Actor, ActorContext
from models.engine import LoadedModel, load_store
from models.store import WeightStore
from models.transformer import Transformer
from models.weights import StreamingWeights
from models.sampling import SamplingConfig
from speculative.draft import Drafter, TreeConfig
from speculative.tree import best_branch


class DraftActor(Actor):
    role = "draft"

    def __init__(self, init: dict, ctx: ActorContext):
        super().__init__(init, ctx)
        torch.set_num_threads(int(init.get("threads") or torch.get_num_threads()))
        with self.trace.span("load draft", cat="setup"):
            if init.get("embed_on_disk"):  # under a memory budget: every group but the embedding table
                store = WeightStore(init["store"])
                weights = StreamingWeights(store, set(store.group_names()) - {"embed"}, init.get("head_rows") or None)
                self.lm = LoadedModel(init.get("name", ""), store, None, Transformer(store.args, weights))
            else:
                self.lm = load_store(init["store"], init.get("name", ""))
        self.sampling = self.base_sampling = SamplingConfig(**init["sampling"])
        self.cfg = TreeConfig(**init["tree"])
        self.drafter = None
        self.last = None  # the tree of the last `build`, until `advance`

    def op_start(self, args, tensors):
        cfg = TreeConfig(**args["tree"]) if "tree" in args else self.cfg
        self.sampling = SamplingConfig(**args["sampling"]) if "sampling" in args else self.base_sampling
        self.drafter = Drafter(self.lm.model, self.sampling, cfg)
        self.drafter.start(list(args["prompt_ids"]), int(args["capacity"]))
        self.drafter.push(list(args["first"]))
        return {}

    def op_build(self, args, tensors):
        """A tree of at most `budget` tokens; sampling distributions go to the slot in `dists`."""
        self.last = self.drafter.build_tree(int(args["budget"]))
        return self._reply(self.last, tensors)

    def op_lookup(self, args, tensors):
        """Prompt lookup: a tree of the trie's candidates alone, no draft forward ({"tokens": []}: none).
        The draft ran on none of it, so no tree is kept for `advance` (it takes the verdict as a plain step's)."""
        self.last = None
        d = self.drafter.lookup(int(args["max_nodes"]))
        return {"tokens": []} if d is None else self._reply(d, tensors)

    def _reply(self, d, tensors):
        out = {**d.tree.to_lists(), "tc": d.tc, "forwards": d.forwards, "trie_nodes": d.trie_nodes}
        if self.sampling.greedy:
            return out
        rows, dists = d.wire_trials()
        out["trials"] = rows
        if not dists:  # point masses only (trie candidates)
            return out
        stacked = torch.stack(dists).float()
        return out, {"dists": self.put(tensors["slot"], stacked)}

    def op_ahead(self, args, tensors):
        """Draft on while the target verifies the last tree, until the verdict arrives (LLMCad 3.4)."""
        return {"steps": self.drafter.look_ahead(self.last, int(args["steps"]), stop=self.interrupted)}

    def op_advance(self, args, tensors):
        """The verdict: accepted nodes of the last tree (empty list and no tree: a plain step) and the new tokens."""
        d = self.last if args.get("tree", True) else None
        path, new = list(args["path"]), list(args["new"])
        self.drafter.advance(d, path, new)
        if d is not None:
            self.drafter.update_threshold(d, *best_branch(d.tree, path))
        self.last = None
        dr = self.drafter
        return {"alpha": dr.threshold.alpha, "ahead_steps": dr.ahead_steps, "ahead_reused": dr.ahead_reused}
