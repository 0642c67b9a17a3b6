"""Distribution-preserving acceptance for sampled drafts.

A chain (Leviathan et al. 2023): accept draft token x with probability min(1, p(x) / q(x)); on
rejection draw from norm(max(0, p - q)). A tree (SpecInfer's multi-round speculative sampling):
at each node the children were drawn i.i.d. from q; try them in draw order, each rejection
replacing p by norm(max(0, p - q)); if none is accepted, draw from what is left of p. Either
way the emitted token has exactly the target's distribution p.
"""
from __future__ import annotations

from typing import Callable

import torch

from speculative.tree import ROOT, TokenTree


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    r = (p - q).clamp(min=0)
    s = r.sum()
    return r / s if s > 0 else p


def accept_sampled(tree: TokenTree, trials: dict[int, list[int]], target_p: Callable[[int], torch.Tensor],
                   draft_q: Callable[[int], torch.Tensor], uniform: Callable[[], float],
                   draw: Callable[[torch.Tensor], int]) -> tuple[list[int], int]:
    """Walk the tree from the root. `trials[node]` lists the child drawn at each of the node's draws
    (ROOT for the root; a child repeats when it was drawn twice); `target_p(row)` is the target's
    distribution after block row `row`, `draft_q(node)` the draft's at a node. Returns the accepted
    nodes and the next token, drawn from the target's (residual) distribution."""
    path: list[int] = []
    node, row = ROOT, 0
    while True:
        p = target_p(row)
        tries = trials.get(node, [])
        q = draft_q(node) if tries else None
        for child in tries:
            x = tree.nodes[child].token
            if uniform() * float(q[x]) < float(p[x]):
                path.append(child)
                node, row = child, child + 1
                break
            p = residual(p, q)
        else:
            return path, draw(p)
