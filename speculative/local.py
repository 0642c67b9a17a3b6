"""The two sides of the speculation cycle with the models in this process (speculative/loop.py).

The draft actor runs `LocalDraft` itself (actors/draft.py), so what the draft does with a verdict
is written here once, whichever process it runs in.
"""
from __future__ import annotations

import torch

from cadence.settings import LOOKUP, SamplingConfig, TreeConfig
from models.transformer import Transformer
from speculative.draft import DraftTree, Drafter, trials_from_wire
from speculative.loop import Proposal
from speculative.tree import TokenTree, best_branch
from speculative.verify import Verifier


class LocalTarget:
    streamed = False
    io_wait = None

    def __init__(self, model: Transformer):
        self.model = model
        self.verifier: Verifier | None = None

    def start(self, prompt_ids: list[int], capacity: int, sampling: SamplingConfig) -> tuple[int, int]:
        """Prefill; the last generation's cache is kept where this prompt continues its text."""
        self.verifier = Verifier(self.model, sampling, previous=self.verifier)
        return self.verifier.start(prompt_ids, capacity), self.verifier.reused

    def step(self, root: int) -> int:
        return self.verifier.step(root)

    def verify(self, p: Proposal) -> tuple[list[int], int]:
        if isinstance(p.payload, DraftTree):
            v = self.verifier.verify(p.payload)
        else:  # the trie's candidates, in their wire form (speculative/lookup.py)
            tree, trials = TokenTree.from_lists(p.payload), None
            if not self.verifier.sampling.greedy and "trials" in p.payload:
                trials = trials_from_wire(p.payload["trials"], None)
            v = self.verifier.verify_tree(tree, trials)
        return v.path, v.next_token

    def take_stats(self) -> dict:
        return {}


def proposal(d: DraftTree | None, drafted: bool = True) -> Proposal | None:
    if d is None:
        return None
    return Proposal([n.token for n in d.tree.nodes], d.forwards, d.trie_nodes, d, drafted)


class LocalDraft:
    has_model = True

    def __init__(self, model: Transformer):
        self.model = model
        self.drafter: Drafter | None = None

    def start(self, prompt_ids: list[int], capacity: int, first: int, cfg: TreeConfig, sampling: SamplingConfig):
        self.drafter = Drafter(self.model, sampling, cfg)
        self.drafter.start(prompt_ids, capacity)
        self.drafter.push([first])

    def propose(self, budget: int, width: int) -> Proposal | None:
        if budget == LOOKUP:  # the trie's candidates alone: the draft runs on none of them
            return proposal(self.drafter.lookup(width), drafted=False)
        return proposal(self.drafter.build_tree(budget))

    def ahead(self, p: Proposal | None, steps: int, stop=lambda: False) -> int:
        """In one process the lookahead runs before the verdict (in the draft actor, until it arrives)."""
        return self.drafter.look_ahead(p.payload if p is not None else None, steps, stop)

    def advance(self, p: Proposal | None, path: list[int], new: list[int]) -> float:
        """Keep the accepted nodes the draft ran on; adapt the fallback threshold to the verdict."""
        d = p.payload if p is not None else None
        self.drafter.advance(d, path, new)
        if d is not None:
            self.drafter.update_threshold(d, *best_branch(d.tree, path))
        return self.drafter.threshold.alpha

    def release(self, p: Proposal) -> None:
        pass

    def ahead_counts(self) -> tuple[int, int]:
        return self.drafter.ahead_steps, self.drafter.ahead_reused

    def wire(self, p: Proposal | None, greedy: bool) -> tuple[dict, list[torch.Tensor]]:
        """A proposal as the draft actor sends it: the tree as lists, and under sampling the trials
        (rows of [node, child, distribution index]) and the distributions they index."""
        if p is None:
            return {"tokens": []}, []
        d = p.payload
        out = {**d.tree.to_lists(), "tc": d.tc, "forwards": d.forwards, "trie_nodes": d.trie_nodes}
        if greedy:
            return out, []
        out["trials"], dists = d.wire_trials()
        return out, dists
