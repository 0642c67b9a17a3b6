"""Growing a greedy draft tree best first (EAGLE-2's dynamic tree, Sequoia's objective), a part of the drafter.

Under greedy verification a tree node is accepted only if every node on its path is, so with a calibrated
draft a node is worth its cumulative probability (the product of the draft's probabilities down its path),
and a tree's expected accepted length is the sum of its nodes' worths. A node is never worth more than its
parent, so the `budget` candidates of the greatest worth always form a tree: the tree of the greatest
expected length the draft can see. LLMCad's pacer (speculative/policy.py) instead always opens a fed node's
top child, and a sibling only above a fixed threshold: at the same width it leaves out likely siblings near
the root for unlikely nodes deep in a chain, and accepts fewer tokens a verification at the same width
(BENCHMARKS.md, "Best-first draft trees, and the widest tree the disk hides").

The draft runs on `feed(budget)` candidates per forward (a forward of a few rows costs about one: it reads the
same weights), the best ones whose children could still make the cut; the tree then keeps its `budget` best
nodes, run on or not. Two a forward up to 16 nodes; a 32-wide tree four, which costs it far fewer forwards for
almost the same acceptance (BENCHMARKS.md, "A 32-wide best-first tree with four candidates a draft forward").
"""

from __future__ import annotations

import heapq

import torch

from common.settings import DRAFT_ROWS, TOP_K
from models.attention import Visibility
from speculative.tree import ROOT, DraftTree

FEED = 2  # candidates run through the draft per forward: at least this many,
FEED_NODES = 8  # ... or one per this many of the tree's nodes where that is more (a 32-wide tree: four)


def feed(budget: int) -> int:
    """Candidates a draft forward runs on, for a tree of `budget` nodes."""
    return max(FEED, budget // FEED_NODES)


class BestFirst:
    """Drafter's best-first growth: it uses the drafter's cache, config, threshold, model, `_dist`, `_child`,
    `_reweigh` and `_ready`."""

    def _feed_nodes(self, d: DraftTree, nodes: list[int]) -> list[torch.Tensor]:
        """One draft forward over tree `nodes` (their ancestors fed already): each row sees the committed
        text, its ancestors' KV slots and its own new one. Marks them fed; their next-token distributions."""
        t, c, dev = d.tree, self.cache, self.model.device
        ptr, rows = [0], []
        for j, node in enumerate(nodes):
            rows += [t.nodes[a].slot for a in t.path(node)[:-1]] + [c.end + j]
            ptr.append(len(rows))
        vis = Visibility(c.length, torch.tensor(ptr, dtype=torch.int32), torch.tensor(rows, dtype=torch.int32))
        tokens = torch.tensor([t.nodes[n].token for n in nodes], device=dev)
        pos = torch.tensor([c.length + t.nodes[n].depth - 1 for n in nodes], device=dev)
        end = c.end
        logits = self.model.forward(tokens, pos, c, vis)
        d.forwards += 1
        dists = []
        for j, node in enumerate(nodes):
            t.nodes[node].fed, t.nodes[node].slot = True, end + j
            dists.append(self._dist(logits[j]))
        return dists

    def _grow_best_first(self, d: DraftTree, fed: list[tuple[int, torch.Tensor]], budget: int) -> None:
        """Grow `d` to the `budget` nodes of the greatest cumulative probability the draft can find from its fed
        nodes' distributions `fed` ((node or ROOT, dist)). Each draft forward runs the `feed` best candidates whose
        children could still make the cut (worth more than the budget-th best node found so far), at most
        DRAFT_ROWS x `budget` rows in all; the tree then keeps its `budget` best nodes (those run on and those not)."""
        t, heap, seq, rows, per = d.tree, [], 0, 0, feed(budget)

        def offer(node: int, dist: torch.Tensor) -> None:
            nonlocal seq
            if self.cfg.ahead:  # drafting ahead may start from this node
                d.dists[node] = dist
            if node != ROOT and t.nodes[node].depth >= self.cfg.max_depth:
                return
            up = t.nodes[node].cum if node != ROOT else 1.0
            top = torch.topk(dist, min(TOP_K, dist.shape[-1]))
            for tok, p in zip(top.indices.tolist(), top.values.tolist()):
                seq += 1
                heapq.heappush(heap, (-up * p, seq, node, tok, p))

        for node, dist in fed:
            offer(node, dist)
        while heap and rows < DRAFT_ROWS * budget:
            bar = _kth([n.cum for n in t.nodes] + [-c[0] for c in heap], budget)
            batch = []
            while heap and len(batch) < min(per, DRAFT_ROWS * budget - rows) and -heap[0][0] > bar:
                _, _, parent, tok, p = heapq.heappop(heap)
                node = self._child(t, parent, tok)
                if node is None:
                    node = t.add(tok, parent, p)
                else:  # a trie candidate the model also proposes: trust the model's probability
                    self._reweigh(t, node, p)
                if not t.nodes[node].fed and self._ready(t, node):
                    batch.append(node)
            if not batch:
                break
            rows += len(batch)
            for node, dist in zip(batch, self._feed_nodes(d, batch)):
                offer(node, dist)
        for _, _, parent, tok, p in heap:  # the candidates not run on, as leaves: the cut below picks among them
            if self._child(t, parent, tok) is None:
                t.add(tok, parent, p)
        self._cut(d, budget)

    def _cut(self, d: DraftTree, budget: int) -> None:
        """Keep the tree's `budget` nodes of the greatest cumulative probability (a parent before its children
        on ties: a node is never worth more than its parent, so they form a tree)."""
        t = d.tree
        if len(t) <= budget:
            return
        best = sorted(range(len(t)), key=lambda i: (-t.nodes[i].cum, t.nodes[i].depth, i))[:budget]
        index = t.keep(sorted(best))
        d.dists = {index[i]: q for i, q in d.dists.items() if i in index}
        d.trie_nodes = sum(1 for i in index if i < d.trie_nodes)


def _kth(values: list[float], k: int) -> float:
    """The k-th greatest of `values` (0.0 where there are fewer)."""
    return heapq.nlargest(k, values)[-1] if len(values) >= k else 0.0
