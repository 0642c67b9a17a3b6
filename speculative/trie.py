"""Model-free drafts from a trie of the prompt's and past outputs' n-grams (Lookahead, section 4.3).

Every run of `branch_len` consecutive tokens of the prompt and of the generated text is inserted
as a branch; node counts say how often a continuation was seen. Given the context, the longest
suffix of it found in the trie (multi-stage: long prefixes first, shorter if they yield little)
points at a node whose subtree is a hierarchical multi-branch draft: shared prefixes merged, the
most frequent continuations first.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class _Node:
    count: int = 0
    children: dict[int, "_Node"] = field(default_factory=dict)


@dataclass(frozen=True)
class Candidates:
    """Retrieved candidates: parents[i] is an index into this list or -1 for the root's children."""

    tokens: list[int]
    parents: list[int]
    probs: list[float]  # count relative to the siblings'
    prefix_len: int  # how many context tokens matched


class TokenTrie:
    def __init__(self, branch_len: int = 8, capacity: int = 200_000):
        self.branch_len, self.capacity = branch_len, capacity
        self.root = _Node()
        self.size = 0

    def insert(self, tokens: list[int], start: int = 0):
        """Insert every window of `branch_len` tokens that starts at or after `start`."""
        for i in range(max(0, start), len(tokens)):
            node = self.root
            for t in tokens[i : i + self.branch_len]:
                child = node.children.get(t)
                if child is None:
                    child = node.children[t] = _Node()
                    self.size += 1
                child.count += 1
                node = child
        if self.size > self.capacity:
            self._prune()

    def _prune(self):
        """Drop the least frequent first tokens (with their subtrees) until half the capacity is left."""
        for t, c in sorted(self.root.children.items(), key=lambda kv: kv[1].count):
            if self.size <= self.capacity // 2:
                break
            self.size -= 1 + self._count(c)
            del self.root.children[t]

    def _count(self, node: _Node) -> int:
        return sum(1 + self._count(c) for c in node.children.values())

    def _match(self, suffix: list[int]) -> _Node | None:
        node = self.root
        for t in suffix:
            node = node.children.get(t)
            if node is None:
                return None
        return node

    def retrieve(
        self,
        context: list[int],
        max_nodes: int,
        max_prefix: int = 6,
        min_prefix: int = 2,
        min_nodes: int = 2,
        keep: Callable[[list[int]], bool] | None = None,
    ) -> Candidates:
        """Candidates continuing `context` (whose last token is the root), best-first by count; `keep(path)`: whether
        a candidate (the run of tokens from the root's child down to it) may be proposed (a grammar's; the ones it
        refuses, and what grows below them, are passed over)."""
        for p in range(min(max_prefix, len(context), self.branch_len - 1), min_prefix - 1, -1):
            node = self._match(context[-p:])
            if node is None or not node.children:
                continue
            draft = self._expand(node, max_nodes, p, keep)
            if len(draft.tokens) >= min_nodes or p == min_prefix:
                return draft
        return Candidates([], [], [], 0)

    @staticmethod
    def _expand(node: _Node, max_nodes: int, prefix_len: int, keep=None) -> Candidates:
        """Best-first by cumulative relative frequency: the likeliest continuations, shared prefixes once."""
        tokens, parents, probs = [], [], []
        heap: list = []
        order = 0  # tie-break: earlier pushes first, for a deterministic draft

        def push(n: _Node, parent: int, cum: float):
            nonlocal order
            total = sum(c.count for c in n.children.values())
            for t, c in n.children.items():
                heapq.heappush(heap, (-cum * c.count / total, order, t, c, parent, c.count / total))
                order += 1

        push(node, -1, 1.0)
        while heap and len(tokens) < max_nodes:
            neg, _, t, c, parent, p = heapq.heappop(heap)
            if keep is not None and not keep(_path(tokens, parents, parent) + [t]):
                continue
            tokens.append(t)
            parents.append(parent)
            probs.append(p)
            if c.children:
                push(c, len(tokens) - 1, -neg)
        return Candidates(tokens, parents, probs, prefix_len)


def _path(tokens: list[int], parents: list[int], i: int) -> list[int]:
    """The tokens from the root's child down to candidate i (-1: none)."""
    out = []
    while i >= 0:
        out.append(tokens[i])
        i = parents[i]
    return out[::-1]


def grammar_keep(constraint, context: list[int]):
    """`retrieve`'s `keep` under a grammar (speculative/grammar.py `Constraint`; None: every candidate kept): the runs it
    allows after `context`."""
    if constraint is None:
        return None
    return lambda path: constraint.keeps(context, [path])[0]
