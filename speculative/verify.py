"""The target side: one forward over the whole tree, then acceptance and the cache kept to it."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from models.attention import Visibility
from models.sampling import Sampler, SamplingConfig, probs
from models.transformer import Transformer
from speculative.draft import DraftTree
from speculative.sampling import accept_sampled
from speculative.tree import TokenTree, longest_accepted_path


@dataclass
class Verdict:
    path: list[int]  # accepted tree nodes, root-most first
    next_token: int  # the target's own token after them
    rows: int  # block rows the target scored


class Verifier:
    def __init__(self, model: Transformer, sampling: SamplingConfig):
        self.model, self.sampling = model, sampling
        self.sampler = Sampler(sampling)
        self.cache = None

    def start(self, prompt_ids: list[int], capacity: int) -> int:
        """Prefill the prompt except nothing is left pending; returns the first generated token."""
        from models.engine import prefill

        self.cache = self.model.new_cache(capacity)
        logits = prefill(self.model, self.cache, prompt_ids)
        return self.sampler(logits)

    def step(self, root: int) -> int:
        """A plain decode step: the root alone."""
        c, dev = self.cache, self.model.device
        logits = self.model.forward(torch.tensor([root], device=dev), torch.tensor([c.length], device=dev), c)[0]
        c.commit()
        return self.sampler(logits)

    def verify(self, d: DraftTree) -> Verdict:
        return self.verify_tree(d.tree, d.trials)

    def verify_tree(self, tree: TokenTree, trials: dict | None = None) -> Verdict:
        """One forward over [root] + the tree, acceptance, and the cache kept to the accepted path."""
        c, dev = self.cache, self.model.device
        tokens, parents, depths = tree.flatten()
        vis = Visibility.tree(c.length, parents)
        logits = self.model.forward(torch.tensor(tokens, device=dev), torch.tensor(depths, device=dev) + c.length, c, vis)
        if self.sampling.greedy:
            choice = logits.argmax(-1).tolist()
            path, nxt = longest_accepted_path(tree, lambda row: choice[row])
        else:
            p = lambda row: probs(logits[row], self.sampling)
            path, nxt = accept_sampled(tree, trials or {}, p, self.sampler.uniform, self.sampler.draw)
        c.commit([0] + [i + 1 for i in path])  # the root and the accepted nodes, in order
        return Verdict(path, nxt, len(tokens))
