"""Growing a greedy draft tree best first (EAGLE-2's dynamic tree, Sequoia's objective), over any `NodeFeed`.

Under greedy verification a tree node is accepted only if every node on its path is, so with a calibrated
draft a node is worth its cumulative probability (the product of the draft's probabilities down its path),
and a tree's expected accepted length is the sum of its nodes' worths. A node is never worth more than its
parent, so the `budget` candidates of the greatest worth always form a tree: the tree of the greatest
expected length the draft can see. LLMCad's pacer (speculative/growth.py) instead always opens a fed node's
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

from common.settings import DRAFT_ROWS, TOP_K, TreeConfig
from speculative.growth import NodeFeed
from speculative.tree import ROOT, DraftTree

FEED = 2  # candidates run through the draft per forward: at least this many,
FEED_NODES = 8  # ... or one per this many of the tree's nodes where that is more (a 32-wide tree: four)


def feed(budget: int) -> int:
    """Candidates a draft forward runs on, for a tree of `budget` nodes."""
    return max(FEED, budget // FEED_NODES)


def grow_best_first(d: DraftTree, fed: list[tuple[int, torch.Tensor]], budget: int, cfg: TreeConfig, draft: NodeFeed):
    """Grow `d` to the `budget` nodes of the greatest cumulative probability the draft can find from its fed
    nodes' distributions `fed` ((node or ROOT, dist)). Each draft forward runs the `feed` best candidates whose
    children could still make the cut (worth more than the budget-th best node found so far), at most
    DRAFT_ROWS x `budget` rows in all; the tree then keeps its `budget` best nodes (those run on and those not).

    A generator: each draft forward is `draft.feed_nodes_steps`, whose forward it yields (speculative/feed.py
    `run_here` runs them at once; speculative/draft_batch.py shares them among several trees)."""
    t, heap, seq, rows, per = d.tree, [], 0, 0, feed(budget)

    def offer(node: int, dist: torch.Tensor) -> None:
        nonlocal seq
        if cfg.ahead:  # drafting ahead may start from this node
            d.dists[node] = dist
        if node != ROOT and t.nodes[node].depth >= cfg.max_depth:
            return
        up = t.nodes[node].cum if node != ROOT else 1.0
        top = torch.topk(dist, min(TOP_K, dist.shape[-1]))
        for tok, p in zip(top.indices.tolist(), top.values.tolist()):
            if p <= 0:  # a token the draft's row rules out (a grammar forbids it): never a node
                continue
            seq += 1
            heapq.heappush(heap, (-up * p, seq, node, tok, p))

    for node, dist in fed:
        offer(node, dist)
    while heap and rows < DRAFT_ROWS * budget:
        bar = _kth([n.cum for n in t.nodes] + [-c[0] for c in heap], budget)
        batch = []
        while heap and len(batch) < min(per, DRAFT_ROWS * budget - rows) and -heap[0][0] > bar:
            _, _, parent, tok, p = heapq.heappop(heap)
            node = t.child(parent, tok)
            if node is None:
                node = t.add(tok, parent, p)
            else:  # a trie candidate the model also proposes: trust the model's probability
                t.reweigh(node, p)
            if not t.nodes[node].fed and t.ready(node):
                batch.append(node)
        if not batch:
            break
        rows += len(batch)
        dists = yield from draft.feed_nodes_steps(t, batch)
        d.forwards += 1
        for node, dist in zip(batch, dists):
            offer(node, dist)
    for _, _, parent, tok, p in heap:  # the candidates not run on, as leaves: the cut below picks among them
        if t.child(parent, tok) is None:
            t.add(tok, parent, p)
    cut(d, budget)
    d.tc = t.tree_confidence()


def cut(d: DraftTree, budget: int) -> None:
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
