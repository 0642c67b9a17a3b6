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


def trials_from_wire(rows: list[list[int]], dists) -> dict:
    """Trials as a Tree carries them (rows of [node, child, distribution index or -1]) with the
    distributions they index: node -> [(child, q or None for a point mass)], in draw order."""
    out: dict[int, list] = {}
    for node, child, k in rows:
        out.setdefault(int(node), []).append((int(child), None if k < 0 else dists[k]))
    return out


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    r = (p - q).clamp(min=0)
    s = r.sum()
    return r / s if s > 0 else p


def accept_sampled(
    tree: TokenTree,
    trials: dict[int, list[tuple[int, torch.Tensor | None]]],
    target_p: Callable[[int], torch.Tensor],
    uniform: Callable[[], float],
    draw: Callable[[torch.Tensor], int],
) -> tuple[list[int], int]:
    """Walk the tree from the root. `trials[node]` lists the node's proposals in order, each a child
    and the distribution q it was drawn from (None: a deterministic candidate, q a point mass on it;
    a child repeats when it was drawn twice); `target_p(row)` is the target's distribution after
    block row `row`. Returns the accepted nodes and the next token, drawn from the target's
    (residual) distribution."""
    path: list[int] = []
    node, row = ROOT, 0
    while True:
        p = target_p(row)
        for child, q in trials.get(node, []):
            x = tree.nodes[child].token
            qx = 1.0 if q is None else float(q[x])
            if uniform() * qx < float(p[x]):
                path.append(child)
                node, row = child, child + 1
                break
            if q is None:
                q = torch.zeros_like(p)
                q[x] = 1.0
            p = residual(p, q)
        else:
            return path, draw(p)
