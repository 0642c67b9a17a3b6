"""The draft side of the speculation cycle over the wire: the draft actor (speculative/loop.py).

Only token ids and small tree descriptions travel over the control socket; under sampling the
draft's distributions travel through the arena, in a slot that lives until the verdict.
"""

from __future__ import annotations

from dataclasses import asdict

from common.settings import SamplingConfig, TreeConfig
from scheduler.errors import ActorError
from scheduler.remote import Remote
from scheduler.runtime import Runtime
from speculative.loop import Proposal
from speculative.tree import Tree


class ActorDraft:
    has_model = True

    def __init__(self, sched: Runtime, vocab_size: int, slot: int = 0):
        """`slot`: a batch's generation (speculative/batch.py): the draft actor keeps a draft cache for each."""
        self.s, self.vocab_size, self.slot = sched, vocab_size, slot
        self.draft = Remote(sched, "draft")  # the draft actor's ops (actors/draft.py)
        self.at = {"slot": slot} if slot else {}  # what every op is sent with (the one generation's: nothing)
        self.greedy = True
        self.slots: dict[int, object] = {}  # id(proposal) -> its distributions' arena slot
        self.ahead_req: int | None = None
        self.counts = (0, 0)
        self.alpha = 0.0  # the last verdict's
        self.behind: list[int] = []  # tokens plain steps committed, not sent yet: they go with the next op

    def start(self, prompt_ids: list[int], capacity: int, first: int, cfg: TreeConfig, sampling: SamplingConfig):
        self.greedy = sampling.greedy
        self.counts = (0, 0)
        self.behind = []
        self.ahead_req = None  # drafting ahead of a generation that ended in an error: its reply is nobody's now
        self.draft.start(
            prompt_ids=prompt_ids, capacity=capacity, first=first, tree=cfg, sampling=asdict(sampling), **self.at
        )

    def lookup(self, max_nodes: int) -> Proposal | None:
        """Prompt lookup: the trie's candidates, no draft forward."""
        tree = self.draft.lookup(max_nodes=max_nodes, **self._behind(), **self.at)
        return Proposal(tree, drafted=False) if tree.tokens else None

    def propose(self, budget: int) -> Proposal | None:
        slot = self._dists_slot(budget)
        try:
            tensors = {"slot": self.s.slot_desc(slot)} if slot is not None else {}
            reply = self.draft.call("build", tensors, budget=budget, **self._behind(), **self.at)
        except BaseException:
            if slot is not None:
                self.s.slots.free(slot)
            raise
        return self._held(Proposal(reply.value, dists=reply.tensors.get("dists"), req=reply.req_id), slot)

    def _dists_slot(self, budget: int):
        """Sampled: an arena slot for the draft's distributions of a tree of `budget` (one row per fed node and its
        root), freed at the proposal's `release`; greedy: None."""
        return None if self.greedy else self.s.slots.alloc((budget + 1) * self.vocab_size * 4)

    def _held(self, p: Proposal, slot) -> Proposal:
        """`p`, its distributions' arena slot (if any) kept until its `release`."""
        if slot is not None:
            self.slots[id(p)] = slot
        return p

    def ahead(self, p: Proposal, steps: int) -> None:
        self.ahead_req = self.draft.send("ahead", steps=steps, **self.at)

    def _behind(self) -> dict:
        """What plain steps committed since the draft last heard, for the op that goes now (nothing: no argument)."""
        behind, self.behind = self.behind, []
        return {"behind": behind} if behind else {}

    def advance(self, p: Proposal | None, path: list[int], new: list[int]) -> float:
        if p is None and self.ahead_req is None:  # a plain step: its tokens go with the next op, not a message now
            self.behind += new
            return self.alpha
        adv = self.draft.advance(path=path, new=new, tree=p is not None, **self._behind(), **self.at)
        if self.ahead_req is not None:  # answered before `advance` (one socket, in order), unless a stream poll took it
            req, self.ahead_req = self.ahead_req, None
            r = self.s.take_reply(req)
            if r is not None and not r.ok:
                raise ActorError("draft", "ahead", req, r.error)
        self.counts = (adv.ahead_steps, adv.ahead_reused)
        self.alpha = adv.alpha
        return adv.alpha

    def release(self, p: Proposal) -> None:
        slot = self.slots.pop(id(p), None)
        if slot is not None:
            self.s.slots.free(slot)

    def ahead_counts(self) -> tuple[int, int]:
        return self.counts

    def take_stats(self) -> dict:
        return self.draft.take_stats(**self.at)


def propose_many(asks: list) -> list:
    """A batch's trees: from the draft actor in one op (`build_many`: its forwards shared) where every side is an
    `ActorDraft` of a slot of its own, a sampled one's distributions in an arena slot of its own as `propose`'s
    are (freed at its `release`); else each side's `propose` in turn."""
    sides = [d for d, _ in asks]
    if not all(isinstance(d, ActorDraft) for d in sides) or len({d.slot for d in sides}) < len(sides):
        return [d.propose(budget) for d, budget in asks]
    s, held = sides[0].s, {}
    try:
        for i, (d, budget) in enumerate(asks):
            if (slot := d._dists_slot(budget)) is not None:
                held[i] = slot
        behind = [d._behind().get("behind", []) for d in sides]
        reply = sides[0].draft.call(
            "build_many",
            {f"slot{i}": s.slot_desc(slot) for i, slot in held.items()},
            slots=[d.slot for d in sides],
            budgets=[b for _, b in asks],
            behind=behind,
        )
    except BaseException:
        for slot in held.values():
            s.slots.free(slot)
        raise
    return [
        d._held(Proposal(Tree(**t), dists=reply.tensors.get(f"dists{i}"), req=reply.req_id), held.get(i))
        for i, (d, t) in enumerate(zip(sides, reply.value.trees))
    ]
