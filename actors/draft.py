"""The draft actor: the small model, resident, growing token trees: a thin shell over the in-process
draft side (speculative/drafter.py `LocalDraft`), so both runtimes draft with the same code."""

from __future__ import annotations

import dataclasses

import torch

from actors.base import Actor, ActorContext
from common.heap import trim_heap
from actors.calls import Advanced, Trees, record
from actors.starts import DraftStart
from formats.loading import load_store
from formats.store import WeightStore
from common.settings import SamplingConfig
from speculative.drafter import LocalDraft
from common.settings import TreeConfig
from speculative.tree import Tree


NO_TREE = Tree(-1, [], [], [])  # no candidates


class DraftActor(Actor):
    role = "draft"

    def __init__(self, init: dict, ctx: ActorContext):
        super().__init__(init, ctx)
        start = record(DraftStart, init, "the draft's start")
        torch.set_num_threads(start.threads or torch.get_num_threads())
        with self.trace.span("load draft", cat="setup"):
            # every group but the embedding table; the head's frequent-token rows only where `head_rows` says
            rows, flash = start.head_rows or None, start.flash
            if flash:  # --draft flash: the target's attention and head, its FFN from neuron caches
                from flash.sparse_target import streamed_flash_draft

                store = WeightStore(start.store)
                model = streamed_flash_draft(store, flash.density, flash.predictor, flash.capacity, rows)
            else:
                model = load_store(start.store, start.name, head_rows=rows, tokenizer=False).model
        self.base_sampling = start.sampling
        self.cfg = start.tree
        self.model = model
        model.kv_dtype = start.kv_dtype  # its caches' keys and values (--kv-dtype)
        self.slots = {0: LocalDraft(model)}  # a batch of generations: a draft side (its own cache) per slot
        self.flash = bool(flash)
        self.last: dict[int, object] = {}  # a slot's proposal of its last `build`, until `advance`

    def _slot(self, slot: int) -> LocalDraft:
        if slot not in self.slots:
            self.slots[slot] = LocalDraft(self.model)
        return self.slots[slot]

    def op_start(
        self,
        prompt_ids: list,
        capacity: int,
        first: int,
        tree: TreeConfig | None = None,
        sampling: dict | None = None,
        slot: int = 0,
    ):
        """A new prompt and the first generated token; `tree`: this generation's tree settings. `slot`: which of a
        batch's generations (speculative/batch.py), each with a draft cache of its own; every op takes it."""
        sampling = SamplingConfig(**sampling) if sampling else self.base_sampling
        self._slot(slot).start(list(prompt_ids), capacity, first, tree or self.cfg, sampling)
        return {}

    def _catch_up(self, slot: int, behind: list | None) -> None:
        """`behind`: what plain steps committed since the last op (the scheduler sends them with the next)."""
        if behind:
            self._slot(slot).advance(None, [], list(behind))

    def op_build(self, budget: int, slot: int = 0, behind: list | None = None):
        """A tree of at most `budget` tokens (speculative/tree.py `Tree`; none: no tokens). `behind`: tokens plain
        steps committed since the draft last heard (every op on a generation's text takes them)."""
        self._catch_up(slot, behind)
        self.last[slot] = p = self._slot(slot).propose(budget)
        self._give_heap_back(slot)
        return self._reply(p)

    def op_build_many(self, slots: list, budgets: list, behind: list | None = None):
        """A batch's trees, one for each of `slots` of at most its `budgets` tokens, grown in shared draft forwards
        (speculative/draft_batch.py): each the tree `build` grows for that slot alone. `behind`: each slot's tokens
        from plain steps since the draft last heard."""
        behind = behind or [[] for _ in slots]
        if not (len(slots) == len(budgets) == len(behind)) or len(set(slots)) != len(slots):
            raise ValueError("build_many takes one budget (and one list behind) for each of distinct slots")
        for s, b in zip(slots, behind):
            self._catch_up(int(s), b)
        ps = LocalDraft.propose_many([(self._slot(int(s)), int(b)) for s, b in zip(slots, budgets)])
        trees = []
        for s, p in zip(slots, ps):
            self.last[s] = p
            self._give_heap_back(s)
            trees.append(dataclasses.asdict(self._reply(p)))
        return Trees(trees)

    def _give_heap_back(self, slot: int):
        """A forward over the prompt (the first tree's, or ahead of it) freed its activations, and a flash draft
        its dense FFN reads, into the heap's arenas, which glibc keeps and a memory cgroup counts (enough to be
        OOM-killed: BENCHMARKS.md, "`--draft flash` with the int2 predictor, under 1.0 GiB"). Given back once per
        prompt; a flash draft's, after every tree too (its neuron reads' buffers add up over a generation, and a
        trim costs far less than one of its steps)."""
        if self.slots[slot].fed_prompt() or self.flash:
            trim_heap()

    def op_lookup(self, max_nodes: int, slot: int = 0, behind: list | None = None):
        """Prompt lookup: a tree of the trie's candidates alone, no draft forward. The draft ran on none of
        it, so no tree is kept for `advance` (it takes the verdict as a plain step's)."""
        self._catch_up(slot, behind)
        self.last.pop(slot, None)
        return self._reply(self._slot(slot).lookup(max_nodes))

    @staticmethod
    def _reply(p):
        return NO_TREE if p is None else p.tree

    def op_ahead(self, steps: int, slot: int = 0):
        """Draft on while the target verifies the last tree, at most `steps` forwards, until the verdict arrives
        (LLMCad 3.4)."""
        steps = self._slot(slot).ahead(self.last.get(slot), steps, stop=self.interrupted)
        self._give_heap_back(slot)
        return {"steps": steps}

    def op_take_stats(self, slot: int = 0):
        """What the draft measured since the last ask (a flash draft's reads), for the generation's row."""
        return self._slot(slot).take_stats()

    def op_advance(self, path: list, new: list, tree: bool = True, slot: int = 0, behind: list | None = None):
        """The verdict: the accepted nodes of the last tree and the committed tokens (`tree` false: a plain step,
        or the trie's candidates, which the draft did not run on)."""
        self._catch_up(slot, behind)
        p = self.last.pop(slot, None)
        p = p if tree else None
        local = self._slot(slot)
        alpha = local.advance(p, list(path), list(new))
        return Advanced(alpha, *local.ahead_counts())
