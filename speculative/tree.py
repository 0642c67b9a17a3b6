"""The token tree: draft candidates hanging off the last committed token (the root).

Nodes are numbered in the order they are added, so a parent always comes before its children;
`flatten` lays the root and the nodes out as one verification block (row 0 is the root, row
i + 1 is node i) with a parent row for each, which is what the tree attention mask needs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the drafter's trees hold its distributions; this module itself stays torch-free
    import torch

ROOT = -1


@dataclass
class Node:
    token: int
    parent: int  # ROOT or an earlier node
    depth: int  # 1 for the root's children
    prob: float  # draft probability of this token given its parent
    cum: float  # product of the probabilities from the root down to this node
    children: list[int] = field(default_factory=list)
    fed: bool = False  # the draft has run on this node (its children are known)
    slot: int = -1  # its draft KV-cache slot, once fed


class TokenTree:
    def __init__(self, root_token: int):
        self.root_token = root_token
        self.nodes: list[Node] = []
        self.root_children: list[int] = []

    def __len__(self) -> int:
        return len(self.nodes)

    def add(self, token: int, parent: int, prob: float) -> int:
        up = self.nodes[parent] if parent != ROOT else None
        node = Node(token, parent, 1 if up is None else up.depth + 1, prob, prob * (1.0 if up is None else up.cum))
        self.nodes.append(node)
        i = len(self.nodes) - 1
        (self.root_children if up is None else up.children).append(i)
        return i

    def chain(self, tokens: list[int], parent: int = ROOT) -> int:
        """`tokens` as a run of certain nodes (probability 1: a grammar allows them alone) below `parent`; the last
        one (`parent` where there are none)."""
        for tok in tokens:
            parent = self.add(tok, parent, 1.0)
        return parent

    def children(self, i: int) -> list[int]:
        return self.root_children if i == ROOT else self.nodes[i].children

    def child(self, i: int, token: int) -> int | None:
        """Node i's (or the root's) child holding `token`, if any."""
        return next((c for c in self.children(i) if self.nodes[c].token == token), None)

    def ready(self, i: int) -> bool:
        """The draft can run on node i: its parent is the root or was run on (so every ancestor was)."""
        p = self.nodes[i].parent
        return p == ROOT or self.nodes[p].fed

    def reweigh(self, i: int, prob: float) -> None:
        """Give node i the probability `prob` (a trie candidate the draft also proposes: the draft's probability
        counts); its descendants' cumulative probabilities follow."""
        n = self.nodes[i]
        up = self.nodes[n.parent].cum if n.parent != ROOT else 1.0
        n.prob, n.cum = prob, up * prob
        stack = list(n.children)
        while stack:
            c = self.nodes[stack.pop()]
            c.cum = self.nodes[c.parent].cum * c.prob
            stack.extend(c.children)

    def path(self, i: int) -> list[int]:
        """Node indices from the root's child down to i."""
        out = []
        while i != ROOT:
            out.append(i)
            i = self.nodes[i].parent
        return out[::-1]

    def tips(self) -> list[int]:
        """Branch tips: nodes the draft has not run on yet."""
        return [i for i, n in enumerate(self.nodes) if not n.fed]

    def branches(self) -> list[int]:
        """One node per root-to-leaf path: its leaf."""
        return [i for i, n in enumerate(self.nodes) if not n.children]

    def tree_confidence(self) -> float:
        """Tc: the largest cumulative confidence over the branches (LLMCad section 3.3)."""
        return max((self.nodes[i].cum for i in self.branches()), default=1.0)

    def flatten(self) -> tuple[list[int], list[int], list[int]]:
        """(tokens, parent rows, depths) of the verification block: row 0 the root, row i + 1 node i."""
        tokens = [self.root_token] + [n.token for n in self.nodes]
        parents = [-1] + [n.parent + 1 for n in self.nodes]  # ROOT (-1) maps to row 0
        depths = [0] + [n.depth for n in self.nodes]
        return tokens, parents, depths

    def keep(self, indices: list[int]) -> dict[int, int]:
        """Keep only the nodes `indices` (ascending, each one's parent among them or the root), renumbered in
        order; returns old index -> new."""
        index = {old: new for new, old in enumerate(indices)}
        nodes, self.nodes, self.root_children = self.nodes, [], []
        for old in indices:
            n = nodes[old]
            parent = ROOT if n.parent == ROOT else index[n.parent]
            self.nodes.append(dataclasses.replace(n, parent=parent, children=[]))
            (self.root_children if parent == ROOT else self.nodes[parent].children).append(index[old])
        return index

    def tokens_of(self, path: list[int]) -> list[int]:
        return [self.nodes[i].token for i in path]

    def proposal(
        self,
        tc: float = 1.0,
        forwards: int = 0,
        trie_nodes: int = 0,
        catchup_s: float = 0.0,
    ) -> "Tree":
        """The tree as the target takes it: plain lists, msgpack-able."""
        return Tree(
            self.root_token,
            [n.token for n in self.nodes],
            [n.parent for n in self.nodes],
            [n.prob for n in self.nodes],
            tc,
            forwards,
            trie_nodes,
            catchup_s,
        )

    @classmethod
    def of(cls, p: "Tree") -> "TokenTree":
        t = cls(int(p.root))
        for tok, parent, prob in zip(p.tokens, p.parents, p.probs):
            if not -1 <= parent < len(t.nodes):
                raise ValueError(f"tree node {len(t.nodes)} has parent {parent}, which does not come before it")
            t.add(int(tok), int(parent), float(prob))
        return t


@dataclass(frozen=True)
class Tree:
    """Candidates for one verification, as the target side takes them in any process (and as they travel:
    the draft actor's reply, the verifier's `verify` request). Node i holds `tokens[i]` under `parents[i]`
    (ROOT: the root) with draft probability `probs[i]`."""

    root: int
    tokens: list
    parents: list
    probs: list
    tc: float = 1.0  # the tree's confidence
    forwards: int = 0  # draft forwards that built it
    trie_nodes: int = 0  # nodes the trie proposed
    catchup_s: float = 0.0  # of the drafting, a forward over text the draft had missed (the prompt, plain steps)

    @property
    def worth(self) -> tuple:
        """The nodes' cumulative draft probabilities (each node's times its ancestors'), greatest first: what the
        governor prices a budget by (speculative/governor.py)."""
        cum: list[float] = []
        for parent, p in zip(self.parents, self.probs):
            cum.append(p * (1.0 if parent == ROOT else cum[parent]))
        return tuple(sorted(cum, reverse=True))

    @property
    def depth(self) -> int:
        """The deepest node's depth (1: the root's children)."""
        d: list[int] = []
        for parent in self.parents:
            d.append(1 if parent == ROOT else d[parent] + 1)
        return max(d, default=0)


@dataclass(frozen=True)
class Verdict:
    """What a verification decided: the accepted tree nodes, root-most first; the target's own token after
    them; the block rows it scored."""

    path: list
    next_token: int
    rows: int


def longest_accepted_path(tree: TokenTree, target_choice) -> tuple[list[int], int]:
    """Greedy verification: follow, from the root, the child whose token is the target's own choice.

    `target_choice(row)` is the target's token after block row `row` (0 is the root). Returns the
    accepted node indices and the target's token after the last of them (the correction, or the
    bonus token when a whole branch is accepted).
    """
    path: list[int] = []
    row = 0
    while True:
        want = target_choice(row)
        nxt = next((c for c in tree.children(path[-1] if path else ROOT) if tree.nodes[c].token == want), None)
        if nxt is None:
            return path, want
        path.append(nxt)
        row = nxt + 1


def best_branch(tree: TokenTree, accepted: list[int]) -> tuple[int, int]:
    """(N_all, N_correct) of the most matching branch (LLMCad eq. 3).

    The most matching branch is the draft's most confident root-to-leaf path through the accepted
    nodes; N_all is its length and N_correct the accepted part of it.
    """
    start = accepted[-1] if accepted else ROOT
    leaf, best, stack = start, -1.0, [start]
    while stack:
        i = stack.pop()
        kids = tree.children(i)
        if not kids and i != ROOT and tree.nodes[i].cum > best:
            leaf, best = i, tree.nodes[i].cum
        stack.extend(kids)
    n_all = tree.nodes[leaf].depth if leaf != ROOT else 0
    return max(n_all, len(accepted)), len(accepted)


@dataclass
class DraftTree:
    tree: TokenTree
    tc: float
    forwards: int
    trie_nodes: int = 0
    catchup_s: float = 0.0  # a first forward over more than the last verification's tokens (`Tree.catchup_s`)
    dists: dict[int, torch.Tensor] = field(default_factory=dict)  # drafting ahead: a fed node's next-token distribution
