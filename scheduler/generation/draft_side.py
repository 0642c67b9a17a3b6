"""The draft side of the speculation cycle over the wire: the draft actor (speculative/loop.py).

Only token ids and small tree descriptions travel over the control socket: under sampling too, the verifier
needs nothing of the draft's distributions (models/sampling.py).
"""

from __future__ import annotations

from dataclasses import asdict

from common.settings import SamplingConfig, TreeConfig
from scheduler.errors import ActorError
from scheduler.remote import Remote
from scheduler.runtime import Runtime
from speculative.sides import Proposal
from speculative.tree import Tree


class ActorDraft:
    has_model = True

    def __init__(self, sched: Runtime, slot: int = 0):
        """`slot`: a batch's generation (speculative/batch.py): the draft actor keeps a draft cache for each."""
        self.s, self.slot = sched, slot
        self.draft = Remote(sched, "draft")  # the draft actor's ops (actors/draft.py)
        self.at = {"slot": slot} if slot else {}  # what every op is sent with (the one generation's: nothing)
        self.ahead_req: int | None = None
        self.counts = (0, 0)
        self.alpha = 0.0  # the last verdict's
        self.behind: list[int] = []  # tokens plain steps committed, not sent yet: they go with the next op

    def start(self, prompt_ids: list[int], capacity: int, first: int, cfg: TreeConfig, sampling: SamplingConfig):
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
        reply = self.draft.call("build", None, budget=budget, **self._behind(), **self.at)
        return Proposal(reply.value, req=reply.req_id)

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

    def ahead_counts(self) -> tuple[int, int]:
        return self.counts

    def take_stats(self) -> dict:
        return self.draft.take_stats(**self.at)


def propose_many(asks: list) -> list:
    """A batch's trees: from the draft actor in one op (`build_many`: its forwards shared) where every side is an
    `ActorDraft` of a slot of its own; else each side's `propose` in turn."""
    sides = [d for d, _ in asks]
    if not all(isinstance(d, ActorDraft) for d in sides) or len({d.slot for d in sides}) < len(sides):
        return [d.propose(budget) for d, budget in asks]
    behind = [d._behind().get("behind", []) for d in sides]
    reply = sides[0].draft.call(
        "build_many", None, slots=[d.slot for d in sides], budgets=[b for _, b in asks], behind=behind
    )
    return [Proposal(Tree(**t), req=reply.req_id) for t in reply.value.trees]
