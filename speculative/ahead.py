"""Speculative drafting during verification (LLMCad §3.4): while the target verifies a tree, the draft grows a
greedy chain from its most confident leaf; when the target accepts that leaf and its next token, the next tree
starts from the chain (`settle` keeps it as an `AheadSeed`, `plant` puts it into the next tree) instead of
drafting it again."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from common.settings import TreeConfig
from speculative.feed import DraftFeed
from speculative.tree import ROOT, DraftTree, TokenTree


@dataclass
class AheadChain:
    """A greedy chain grown from the tree's most confident leaf while the target verifies the tree. `fed`: the
    chain's nodes the draft ran on, each (token, KV slot, next-token distribution); the first is the leaf itself."""

    leaf: int
    fed: list[tuple[int, int, torch.Tensor]] = field(default_factory=list)


@dataclass
class AheadSeed:
    """What a reused ahead chain leaves for the next tree: the root's distribution and a chain of
    nodes already fed (their KV entries pending in the draft cache, in order)."""

    root_dist: torch.Tensor
    tokens: list[int]
    dists: list[torch.Tensor]


class DraftingAhead:
    """The chain drafted during the current verification (`chain`), what the next tree reuses of it (`seed`),
    and the generation's counts: `steps` (draft forwards run ahead) and `reused` (tree nodes planted from them).
    It runs the draft through `feed`, on slots after the tree's."""

    def __init__(self, feed: DraftFeed, cfg: TreeConfig, plain: bool):
        """`plain`: the generation's tokens are plain argmaxes (models/sampling.py), which a chain drafted ahead
        predicts; with penalties or a draw a node's choice depends on its own text, and no chain is drafted."""
        self.feed, self.cfg, self.plain = feed, cfg, plain
        self.chain: AheadChain | None = None
        self.seed: AheadSeed | None = None
        self.steps = self.reused = 0

    def draft(self, d: DraftTree | None, steps: int, stop=lambda: False) -> int:
        """While the target verifies `d`, grow a greedy chain from its most confident leaf, one draft forward
        per step, until `stop()` (the verdict has arrived) or `steps`. `settle` keeps the chain when the target
        accepts that leaf and its next token. Returns the forwards run."""
        self.chain = None
        if d is None or not len(d.tree) or steps <= 0 or not self.plain or self.cfg.shape_parents:
            return 0
        t = d.tree
        leaves = [i for i in t.branches() if t.ready(i)]
        if not leaves:
            return 0
        leaf = max(leaves, key=lambda i: t.nodes[i].cum)
        a = self.chain = AheadChain(leaf)
        anc = [t.nodes[i].slot for i in t.path(leaf)[:-1]]
        depth, tok = t.nodes[leaf].depth, t.nodes[leaf].token
        if t.nodes[leaf].fed:  # expanded during the build, its children cut by the budget
            a.fed.append((tok, t.nodes[leaf].slot, d.dists[leaf]))
            anc.append(t.nodes[leaf].slot)
            tok, depth = int(d.dists[leaf].argmax()), depth + 1
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # the verifier runs meanwhile: take one core at most
        try:
            n = self._grow(a, anc, tok, depth, steps, stop)
        finally:
            torch.set_num_threads(threads)
        self.steps += n
        return n

    def _grow(self, a: AheadChain, anc: list[int], tok: int, depth: int, steps: int, stop) -> int:
        n = 0
        while n < steps and self.feed.room > 2 and not stop():
            slot, dist = self.feed.feed_chain(tok, depth, anc)
            a.fed.append((tok, slot, dist))
            anc.append(slot)
            tok, depth, n = int(dist.argmax()), depth + 1, n + 1
        return n

    def discard(self) -> None:
        """A verdict on no tree (a plain step): nothing drafted ahead is kept."""
        self.chain = self.seed = None

    def settle(self, t: TokenTree, path: list[int], new_tokens: list[int]) -> tuple[list[int], int, int]:
        """The verdict on tree `t` (the accepted `path`, then the target's own token): what of the chain drafted
        ahead stays, as (its KV slots to keep after the path's own, how many of `new_tokens` they hold, how many
        more stay pending for the next tree). The leaf stays whenever the target accepts it; the chain after it
        only where its first token is the target's next one, and then all of it: that token becomes the root,
        already fed, and the rest the `seed` of the next tree."""
        a, self.chain, self.seed = self.chain, None, None
        if a is None or not path or path[-1] != a.leaf or not a.fed:
            return [], 0, 0
        slots, n = [], 0
        if not t.nodes[a.leaf].fed:  # a.fed[0] is the leaf, fed during the verification
            slots, n = [a.fed[0][1]], 1
        chain = a.fed[1:]
        if not chain or chain[0][0] != new_tokens[len(path)]:
            return slots, n, 0
        rest = chain[1:]
        self.seed = AheadSeed(chain[0][2], [tok for tok, _, _ in rest], [dist for _, _, dist in rest])
        return slots + [slot for _, slot, _ in chain], n + 1, len(rest)

    def take_seed(self) -> AheadSeed | None:
        """The seed the last verdict left (once)."""
        seed, self.seed = self.seed, None
        return seed

    def plant(
        self,
        d: DraftTree,
        seed: AheadSeed,
        root_dist: torch.Tensor,
        budget: int,
        expand: Callable[[DraftTree, int, torch.Tensor, int], None] | None = None,
    ) -> list[tuple[int, torch.Tensor]]:
        """Put a reused ahead chain into a new tree: its nodes are fed already (their KV entries are the first
        pending slots), so each is expanded from its stored distribution by `expand(d, node, dist, room)`, no
        forward (None: the caller grows the tree from them). The planted (node, distribution) pairs."""
        t, parent, pdist, planted = d.tree, ROOT, root_dist, []
        for j, (tok, dist) in enumerate(zip(seed.tokens, seed.dists)):
            node = t.child(parent, tok)
            if node is None:
                if len(t) >= budget or (t.nodes[parent].depth if parent != ROOT else 0) >= self.cfg.max_depth:
                    break
                node = t.add(tok, parent, float(pdist[tok]))
            t.nodes[node].fed, t.nodes[node].slot = True, self.feed.length + j
            d.dists[node] = dist
            self.reused += 1
            planted.append((node, dist))
            if expand is not None:
                expand(d, node, dist, budget - len(t))
            parent, pdist = node, dist
        return planted
