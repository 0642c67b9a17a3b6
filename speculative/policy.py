"""When to branch, which branch grows next, when to verify (LLMCad sections 3.2-3.3)."""

from __future__ import annotations

from dataclasses import dataclass

from speculative.tree import TokenTree, best_branch


def pace(tree: TokenTree, tips: list[int]) -> int:
    """The branch pacer (LLMCad eq. 1-2): max-min fairness on cumulative confidence.

    With M tokens in the tree, branch x deserves M * C_x / sum(C) of them; it has T_x (its depth).
    The tip whose branch is furthest below its share, f(x) = M C_x / sum C - T_x, grows next.
    """
    m = len(tree)
    total = sum(tree.nodes[i].cum for i in tips) or 1.0

    def deficit(i):
        n = tree.nodes[i]
        return (m * n.cum / total - n.depth, n.cum)

    return max(tips, key=deficit)


@dataclass
class AdaptiveThreshold:
    """alpha of the self-adaptive fallback: verify when Tc < alpha (LLMCad eq. 3)."""

    alpha: float = 0.01
    floor: float = 1e-6
    ceiling: float = 0.9

    def should_verify(self, tc: float) -> bool:
        return tc < self.alpha

    def take(self, tc: float, tree: TokenTree, path: list[int]) -> float:
        """alpha after a verdict on a tree of confidence `tc` that accepted `path`: its most matching branch
        (`best_branch`) against what was accepted of it. The draft and, over the wire, the scheduler's side of it
        both reckon it here."""
        return self.update(tc, *best_branch(tree, path))

    def update(self, tc: float, n_all: int, n_correct: int) -> float:
        if n_all <= 0 or n_correct >= n_all:
            a = self.alpha * 0.5
        else:
            a = self.alpha / max(tc, 1e-12) ** ((n_all - n_correct) / n_all)
        self.alpha = min(self.ceiling, max(self.floor, a))
        return self.alpha


def branch_candidates(probs: list[tuple[int, float]], threshold: float, room: int) -> list[tuple[int, float]]:
    """Children a node opens: its top candidate always, every other one with probability >= threshold.

    `probs` is (token, probability) sorted by probability, descending; at most `room` are returned.
    """
    out = probs[:1] + [(t, p) for t, p in probs[1:] if p >= threshold]
    return out[: max(room, 0)]
