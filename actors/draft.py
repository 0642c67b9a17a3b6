"""The draft actor: the small model, resident, growing token trees: a thin shell over the in-process
draft side (speculative/drafter.py `LocalDraft`), so both runtimes draft with the same code."""

from __future__ import annotations

import dataclasses
import functools

import torch

from actors.base import Actor, ActorContext
from common.heap import trim_heap
from actors.calls import DraftCycle, Drafted, record
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
        self.last: dict[int, object] = {}  # a slot's proposal of its last tree, until its verdict
        self.ahead_error: Exception | None = None

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

    def op_cycle(self, cycles: list):
        """A batch's cycles (actors/calls.py `DraftCycle`, each checked here): every generation's verdict and
        tokens behind taken, then the trees asked for grown, a batch's together in shared draft forwards
        (speculative/draft_batch.py), each the tree its generation grows alone. Drafting ahead runs after the
        reply, until the next message (`Actor.after_reply`)."""
        asks = [record(DraftCycle, c, "a draft cycle") if isinstance(c, dict) else c for c in cycles]
        if len({a.slot for a in asks}) != len(asks) or not all(isinstance(a, DraftCycle) for a in asks):
            raise ValueError("op 'cycle' takes one DraftCycle map for each of distinct slots")
        if self.ahead_error is not None:  # the last cycle's drafting ahead failed: say so with this one
            e, self.ahead_error = self.ahead_error, None
            raise e
        for a in asks:
            self._verdict(a)
        grow = [a for a in asks if a.budget > 0 and not a.lookup]
        grown = LocalDraft.propose_many([(self._slot(a.slot), a.budget, 0) for a in grow])
        trees = {}
        for a, p in zip(grow, grown):
            self.last[a.slot] = p
            trees[a.slot] = self._reply(p)
        for a in asks:
            if a.lookup:  # the trie's candidates: the draft runs on none of them, so no tree is kept for the verdict
                self.last.pop(a.slot, None)
                trees[a.slot] = self._reply(self._slot(a.slot).lookup(a.budget))
        for a in asks:
            self._give_heap_back(a.slot)
        ahead = [(a.slot, a.ahead) for a in grow if a.ahead > 0 and self.last[a.slot] and self.last[a.slot].tokens]
        if ahead:
            self.after_reply = functools.partial(self._ahead, ahead)
        return Drafted(
            [dataclasses.asdict(trees[a.slot]) if a.slot in trees else None for a in asks],
            [list(self._slot(a.slot).ahead_counts()) for a in asks],
        )

    def _verdict(self, a: DraftCycle) -> None:
        """The verdict on the slot's last tree (the accepted nodes it ran on kept), then the tokens behind."""
        local = self._slot(a.slot)
        if a.path is not None:
            local.advance(self.last.pop(a.slot, None), list(a.path), list(a.new))
        if a.behind:
            local.advance(None, [], list(a.behind))

    def _give_heap_back(self, slot: int):
        """A forward over the prompt (the first tree's, or ahead of it) freed its activations, and a flash draft
        its dense FFN reads, into the heap's arenas, which glibc keeps and a memory cgroup counts (enough to be
        OOM-killed: BENCHMARKS.md, "`--draft flash` with the int2 predictor, under 1.0 GiB"). Given back once per
        prompt; a flash draft's, after every tree too (its neuron reads' buffers add up over a generation, and a
        trim costs far less than one of its steps)."""
        if self.slots[slot].fed_prompt() or self.flash:
            trim_heap()

    @staticmethod
    def _reply(p):
        return NO_TREE if p is None else p.tree

    def _ahead(self, asks: list) -> None:
        """Draft on from each slot's tree while the target verifies it, at most its steps, until a message arrives
        (LLMCad 3.4); a failure is said with the next cycle."""
        try:
            for slot, steps in asks:
                if self.interrupted():
                    return
                with self.trace.span("ahead", cat=self.role, args={"slot": slot}):
                    self._slot(slot).ahead(self.last.get(slot), steps, stop=self.interrupted)
                self._give_heap_back(slot)
        except Exception as e:  # noqa: BLE001 (the next cycle's reply carries it)
            self.ahead_error = e

    def op_take_stats(self, slot: int = 0):
        """What the draft measured since the last ask (a flash draft's reads), for the generation's row."""
        return self._slot(slot).take_stats()
