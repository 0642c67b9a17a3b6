"""The draft actor: the small model, resident, growing token trees: a thin shell over the in-process
draft side (speculative/drafter.py `LocalDraft`), so both runtimes draft with the same code."""

from __future__ import annotations

import torch

from actors.base import Actor, ActorContext
from common.heap import trim_heap
from actors.calls import Advanced
from models.loading import load_store
from models.store import WeightStore
from common.settings import SamplingConfig
from speculative.drafter import LocalDraft
from common.settings import TreeConfig
from speculative.tree import Tree


NO_TREE = Tree(-1, [], [], [])  # no candidates


class DraftActor(Actor):
    role = "draft"

    def __init__(self, init: dict, ctx: ActorContext):
        super().__init__(init, ctx)
        torch.set_num_threads(int(init.get("threads") or torch.get_num_threads()))
        with self.trace.span("load draft", cat="setup"):
            # every group but the embedding table; the head's frequent-token rows only where `head_rows` says
            rows, flash = init.get("head_rows") or None, init.get("flash")
            if flash:  # --draft flash: the target's attention and head, its FFN from neuron caches
                from models.flash.sparse_target import streamed_flash_draft

                store = WeightStore(init["store"])
                model = streamed_flash_draft(store, flash["density"], flash["predictor"], flash["capacity"], rows)
            else:
                model = load_store(init["store"], init.get("name", ""), head_rows=rows, tokenizer=False).model
        self.sampling = self.base_sampling = SamplingConfig(**init["sampling"])
        self.cfg = TreeConfig(**init["tree"])
        self.local = LocalDraft(model)
        self.flash = bool(flash)
        self.last = None  # the proposal of the last `build`, until `advance`

    def op_start(
        self, prompt_ids: list, capacity: int, first: int, tree: TreeConfig | None = None, sampling: dict | None = None
    ):
        """A new prompt and the first generated token; `tree`: this generation's tree settings."""
        self.sampling = SamplingConfig(**sampling) if sampling else self.base_sampling
        self.local.start(list(prompt_ids), capacity, first, tree or self.cfg, self.sampling)
        return {}

    def op_build(self, budget: int, tensors: dict):
        """A tree of at most `budget` tokens (speculative/tree.py `Tree`; none: no tokens); under sampling
        its distributions go to the slot in `tensors["slot"]`."""
        self.last = self.local.propose(budget)
        self._give_heap_back()
        return self._reply(self.last, tensors)

    def _give_heap_back(self):
        """A forward over the prompt (the first tree's, or ahead of it) freed its activations, and a flash draft
        its dense FFN reads, into the heap's arenas, which glibc keeps and a memory cgroup counts (enough to be
        OOM-killed: BENCHMARKS.md, "`--draft flash` with the int2 predictor, under 1.0 GiB"). Given back once per
        prompt; a flash draft's, after every tree too (its neuron reads' buffers add up over a generation, and a
        trim costs far less than one of its steps)."""
        if self.local.fed_prompt() or self.flash:
            trim_heap()

    def op_lookup(self, max_nodes: int, tensors: dict):
        """Prompt lookup: a tree of the trie's candidates alone, no draft forward. The draft ran on none of
        it, so no tree is kept for `advance` (it takes the verdict as a plain step's)."""
        self.last = None
        return self._reply(self.local.lookup(max_nodes), tensors)

    def _reply(self, p, tensors):
        if p is None:
            return NO_TREE
        if p.dists is None:  # greedy, or point masses only (trie candidates)
            return p.tree
        return p.tree, {"dists": self.put(tensors["slot"], p.dists)}

    def op_ahead(self, steps: int):
        """Draft on while the target verifies the last tree, at most `steps` forwards, until the verdict arrives
        (LLMCad 3.4)."""
        steps = self.local.ahead(self.last, steps, stop=self.interrupted)
        self._give_heap_back()
        return {"steps": steps}

    def op_take_stats(self):
        """What the draft measured since the last ask (a flash draft's reads), for the generation's row."""
        return self.local.take_stats()

    def op_advance(self, path: list, new: list, tree: bool = True):
        """The verdict: the accepted nodes of the last tree and the committed tokens (`tree` false: a plain step,
        or the trie's candidates, which the draft did not run on)."""
        p = self.last if tree else None
        self.last = None
        alpha = self.local.advance(p, list(path), list(new))
        return Advanced(alpha, *self.local.ahead_counts())
