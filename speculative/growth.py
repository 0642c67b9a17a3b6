"""How a draft tree grows, given a way to run the draft on its nodes: LLMCad's dynamic tree (the branch pacer picks
the tip to grow, the self-adaptive fallback says when to verify, speculative/policy.py) and the chain, or an ARCA
tree shape filled level by level (speculative/arca.py). Best first is bestfirst.py. None of it holds a model or a
cache: `NodeFeed` runs the draft (speculative/feed.py `DraftFeed`; a test may hand in any other).
"""

from __future__ import annotations

from typing import Protocol

import torch

from common.modes import Mode
from common.settings import TOP_K, TreeConfig
from speculative.policy import AdaptiveThreshold, branch_candidates, pace
from speculative.tree import ROOT, DraftTree, TokenTree


class NodeFeed(Protocol):
    def feed_nodes(self, tree: TokenTree, nodes: list[int]) -> list[torch.Tensor]:
        """One draft forward over tree `nodes` (their ancestors fed already): marks them fed, each with its KV
        slot; their next-token distributions."""

    def feed_nodes_steps(self, tree: TokenTree, nodes: list[int]):
        """`feed_nodes` as a generator: yields the forward's rows (models/batch.py `Rows`), is sent their logits."""


class PacedGrowth:
    """LLMCad's dynamic tree: a fed node opens its top candidate and every other above the branch threshold
    (sampling: as many draws), the pacer feeds the tip whose branch is furthest below its share, and the tree
    goes to verification once its confidence Tc falls below alpha (`threshold`, which the verdicts adapt) or it
    reaches the budget. Chain mode: the top candidate alone, to the budget."""

    def __init__(self, cfg: TreeConfig, threshold: AdaptiveThreshold):
        self.cfg, self.threshold = cfg, threshold

    def grow(self, d: DraftTree, budget: int, feed: NodeFeed):
        """Feed tips one draft forward at a time, each expanded from its distribution, until the fallback or the
        budget stops the tree. A generator of those forwards (`NodeFeed.feed_nodes_steps`): run each at once
        (speculative/feed.py `run_here`), or share it with other trees' (speculative/draft_batch.py)."""
        cfg, t = self.cfg, d.tree
        while len(t) < budget:
            if cfg.mode is Mode.TREE and self.threshold.should_verify(t.tree_confidence()):
                break
            # a tip under an unfed node (a trie chain) waits for it: its ancestors' KV entries must exist
            tips = [i for i in t.tips() if t.nodes[i].depth < min(cfg.max_depth, budget) and t.ready(i)]
            if not tips:
                break
            tip = pace(t, tips)
            (dist,) = yield from feed.feed_nodes_steps(t, [tip])
            d.forwards += 1
            if cfg.ahead:  # drafting ahead may start from this node
                d.dists[tip] = dist
            self.expand(d, tip, dist, budget - len(t))
        d.tc = t.tree_confidence()

    def expand(self, d: DraftTree, node: int, dist: torch.Tensor, room: int) -> None:
        """Open node's children from its next-token distribution `dist` (under sampling, the softmax of the scores
        the target's choice there will be the argmax of: models/sampling.py), at most `room` new nodes."""
        t = d.tree
        top = torch.topk(dist, TOP_K)
        cands = [(tok, p) for tok, p in zip(top.indices.tolist(), top.values.tolist()) if p > 0]  # >0: allowed
        if self.cfg.mode is Mode.CHAIN:
            cands = cands[:1]
        for tok, p in branch_candidates(cands, self.cfg.branch_threshold, TOP_K):
            c = t.child(node, tok)
            if c is not None:  # a trie candidate the model also proposes: trust the model's probability
                t.reweigh(c, p)
            elif room > 0:
                t.add(tok, node, p)
                room -= 1


def fill_shape(d: DraftTree, root_dist: torch.Tensor, cfg: TreeConfig, budget: int, feed: NodeFeed) -> None:
    """Fill ARCA's tree shape (`cfg.shape_parents`, `cfg.shape_ranks`: each shape node the rank-th candidate of
    its parent) level by level, one draft forward per level for all its nodes, to at most `budget` nodes."""
    dists = {ROOT: root_dist}
    index = {}  # shape node -> tree node
    level = [i for i, p in enumerate(cfg.shape_parents) if p < 0]
    while level:
        for i in level:
            if len(d.tree) >= budget:
                break
            parent = index[cfg.shape_parents[i]] if cfg.shape_parents[i] >= 0 else ROOT
            dist = dists[parent]
            top = torch.topk(dist, cfg.shape_ranks[i] + 1)
            tok, p = int(top.indices[-1]), float(top.values[-1])
            index[i] = d.tree.add(tok, parent, p)
        nxt = [i for i, p in enumerate(cfg.shape_parents) if p in index and i not in index]
        fed = sorted({index[cfg.shape_parents[i]] for i in nxt})
        if not fed or len(d.tree) >= budget:
            break
        dists.update(zip(fed, feed.feed_nodes(d.tree, fed)))
        d.forwards += 1
        level = nxt
    d.tc = d.tree.tree_confidence()
