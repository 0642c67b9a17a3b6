"""The draft side of the speculation cycle over the wire: the draft actor (speculative/loop.py).

Only token ids and small tree descriptions travel over the control socket: under sampling too, the verifier
needs nothing of the draft's distributions (models/sampling.py).
"""

from __future__ import annotations

from dataclasses import asdict

from common.modes import Mode
from common.settings import SamplingConfig, TreeConfig
from scheduler.remote import Remote
from scheduler.runtime import Runtime
from speculative.sides import Proposal
from speculative.policy import AdaptiveThreshold
from speculative.tree import Tree, TokenTree


class ActorDraft:
    """One generation's draft, in the draft actor: one message a cycle (actors/calls.py `DraftCycle`: the verdict
    on the last tree and what plain steps committed since, which wait for it, then the next tree), one reply.
    alpha after a verdict is reckoned here as the draft reckons it (speculative/policy.py `AdaptiveThreshold`, from
    the tree the verdict is on), so the verdict need not cross before the next tree is asked for."""

    has_model = True

    def __init__(self, sched: Runtime, slot: int = 0):
        """`slot`: a batch's generation (speculative/batch.py): the draft actor keeps a draft cache for each."""
        self.slot = slot
        self.draft = Remote(sched, "draft")  # the draft actor's ops (actors/draft.py)
        self.at = {"slot": slot} if slot else {}  # what `start` and `take_stats` are sent with
        self.counts = (0, 0)
        self.threshold: AdaptiveThreshold | None = None  # the draft's, in tree mode (else alpha stays)
        self.alpha = 0.0
        self.verdict: dict = {}  # the verdict on the last tree, not sent yet: it goes with the next cycle
        self.behind: list[int] = []  # tokens committed without a tree of the draft's since, not sent yet

    def start(self, prompt_ids: list[int], capacity: int, first: int, cfg: TreeConfig, sampling: SamplingConfig):
        self.counts, self.verdict, self.behind = (0, 0), {}, []
        self.threshold = AdaptiveThreshold(cfg.alpha) if cfg.mode is Mode.TREE else None
        self.alpha = cfg.alpha
        self.draft.start(
            prompt_ids=prompt_ids, capacity=capacity, first=first, tree=cfg, sampling=asdict(sampling), **self.at
        )

    def cycle(self, budget: int = 0, lookup: bool = False, ahead: int = 0) -> dict:
        """This generation's `DraftCycle` (as its map): what waits to be sent, and the tree to grow."""
        c = {"slot": self.slot, **self.verdict, "budget": budget, "lookup": lookup, "ahead": ahead}
        if self.behind:
            c["behind"] = self.behind
        self.verdict, self.behind = {}, []
        return c

    def took(self, counts: list) -> None:
        self.counts = (int(counts[0]), int(counts[1]))

    def lookup(self, max_nodes: int) -> Proposal | None:
        """Prompt lookup: the trie's candidates, no draft forward."""
        (p,) = cycles([(self, max_nodes, 0)], lookup=True)
        return p if p.tokens else None

    def propose(self, budget: int, ahead: int = 0) -> Proposal | None:
        return cycles([(self, budget, ahead)])[0]

    def advance(self, p: Proposal | None, path: list[int], new: list[int]) -> float:
        """The verdict, kept for the next cycle's message; alpha after it."""
        if p is None:  # a plain step, or the trie's candidates: tokens the draft catches up on
            self.behind += new
            return self.alpha
        if self.verdict or self.behind:
            raise RuntimeError("a verdict on the draft's tree came before the draft heard the last one")
        self.verdict = {"path": list(path), "new": list(new)}
        if self.threshold is not None:
            self.alpha = self.threshold.take(p.tree.tc, TokenTree.of(p.tree), path)
        return self.alpha

    def ahead_counts(self) -> tuple[int, int]:
        """Drafting ahead's counts in this generation: a verdict not sent yet goes now (its reuse counts)."""
        if self.verdict or self.behind:
            cycles([(self, 0, 0)])
        return self.counts

    def take_stats(self) -> dict:
        return self.draft.take_stats(**self.at)


def cycles(asks: list, lookup: bool = False) -> list:
    """A batch's cycles on the draft actor, one message (op `cycle`) for every (side, budget, drafting ahead) asked:
    each side's proposal, in order (drafted is False where `lookup`: the trie's candidates)."""
    sides = [d for d, _, _ in asks]
    reply = sides[0].draft.call("cycle", None, cycles=[d.cycle(b, lookup, a) for d, b, a in asks])
    out = []
    for d, t, counts in zip(sides, reply.value.trees, reply.value.ahead):
        d.took(counts)
        out.append(Proposal(Tree(**t), drafted=not lookup, req=reply.req_id) if t is not None else None)
    return out


def propose_many(asks: list) -> list:
    """A batch's trees: from the draft actor in one message where every side is an `ActorDraft` of a slot of its own;
    else each side's `propose` in turn."""
    sides = [d for d, _, _ in asks]
    if not all(isinstance(d, ActorDraft) for d in sides) or len({d.slot for d in sides}) < len(sides):
        return [d.propose(budget, ahead) for d, budget, ahead in asks]
    return cycles(asks)
