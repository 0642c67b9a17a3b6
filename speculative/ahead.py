"""Speculative drafting during verification (LLMCad §3.4), a part of the drafter (speculative/drafter.py):
while the target verifies a tree, the draft grows a greedy chain from its most confident leaf; when the
target accepts that leaf and its next token, the next tree starts from the chain (`Drafter.advance`
keeps it as an `AheadSeed`, `_plant` puts it into the next tree) instead of drafting it again."""

from __future__ import annotations

import torch

from speculative.tree import ROOT, DraftTree, AheadChain, AheadSeed


class DraftingAhead:
    """The drafter's drafting ahead: it uses the drafter's cache, config, `_feed_node`, `_child`, `_expand` and
    `_ready`."""

    def _plant(self, d: DraftTree, seed: AheadSeed, root_dist: torch.Tensor, budget: int, expand: bool = True):
        """Put a reused ahead chain into a new tree: its nodes are fed already (their KV entries
        are the first pending slots), so they expand from their stored distributions, no forward (with
        `expand`; else the caller grows the tree from them). The planted (node, distribution) pairs."""
        t, parent, pdist, planted = d.tree, ROOT, root_dist, []
        for j, (tok, dist) in enumerate(zip(seed.tokens, seed.dists)):
            node = self._child(t, parent, tok)
            if node is None:
                if len(t) >= budget or (t.nodes[parent].depth if parent != ROOT else 0) >= self.cfg.max_depth:
                    break
                node = t.add(tok, parent, float(pdist[tok]))
            t.nodes[node].fed, t.nodes[node].slot = True, self.cache.length + j
            d.dists[node] = dist
            self.ahead_reused += 1
            planted.append((node, dist))
            if expand:
                self._expand(d, node, dist, budget - len(t))
            parent, pdist = node, dist
        return planted

    def draft_ahead(self, d: DraftTree | None, steps: int, stop=lambda: False) -> int:
        """Speculative drafting during verification (LLMCad 3.4): while the target verifies `d`, grow a
        greedy chain from its most confident leaf, one draft forward per step, until `stop()` (the
        verdict has arrived) or `steps`. `advance` keeps the chain when the target accepts that leaf
        and its next token. Returns the forwards run."""
        self.ahead = None
        if d is None or not len(d.tree) or steps <= 0 or not self.sampling.greedy or self.cfg.shape_parents:
            return 0
        t = d.tree
        leaves = [i for i in t.branches() if self._ready(t, i)]
        if not leaves:
            return 0
        leaf = max(leaves, key=lambda i: t.nodes[i].cum)
        a = self.ahead = AheadChain(leaf)
        anc = [t.nodes[i].slot for i in t.path(leaf)[:-1]]
        depth, tok = t.nodes[leaf].depth, t.nodes[leaf].token
        if t.nodes[leaf].fed:  # expanded during the build, its children cut by the budget
            a.fed.append((tok, t.nodes[leaf].slot, d.dists[leaf]))
            anc.append(t.nodes[leaf].slot)
            tok, depth = int(d.dists[leaf].argmax()), depth + 1
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # the verifier runs meanwhile: take one core at most
        try:
            n = self._chain(a, anc, tok, depth, steps, stop)
        finally:
            torch.set_num_threads(threads)
        self.ahead_steps += n
        return n

    def _chain(self, a: AheadChain, anc: list[int], tok: int, depth: int, steps: int, stop) -> int:
        c, n = self.cache, 0
        while n < steps and c.end + 2 < c.capacity and not stop():
            slot, dist = self._feed_node(tok, depth, anc)
            a.fed.append((tok, slot, dist))
            anc.append(slot)
            tok, depth, n = int(dist.argmax()), depth + 1, n + 1
        return n
