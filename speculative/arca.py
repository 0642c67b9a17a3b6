"""ARCA (Ghidorah section III-C): choose the verification width, tree shape and partition from measurements.

1. Acceptance: on calibration prompts, the draft runs teacher-forced along the target's own
   greedy continuation; at depth d (the d-th token of a draft chain whose first d - 1 tokens were
   right) we count how often the target's token is the draft's rank-r candidate: acc[d][r].
2. Tree shape for a width W: nodes are paths of ranks; a node's estimated acceptance is the
   product of acc[depth][rank] along its path; starting from the root, the node with the highest
   estimate whose parent is already in the tree is added, one at a time, until W nodes.
   E[accepted] is the sum of the estimates.
3. Throughput: (E[accepted] + 1) / (draft time for the shape + verification time for W + 1 rows,
   per partition); the best entry wins. Width 0 is the target alone (1 / its step time).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

WIDTHS = (1, 2, 4, 8, 16, 32, 64)


def acceptance_table(ranks: list[list[int]], max_depth: int = 8, k: int = 4) -> list[list[float]]:
    """ranks[s][t]: rank (0..k-1, or k for a miss) of the target's token t of sequence s among the
    draft's candidates, teacher-forced. Returns acc[d][r] for depths 1..max_depth (index d - 1)."""
    hits = [[0] * k for _ in range(max_depth)]
    tries = [0] * max_depth
    for seq in ranks:
        for t in range(len(seq)):
            for d in range(max_depth):  # a chain starting at t reaches depth d + 1 if t..t+d-1 were top-1
                if t + d >= len(seq):
                    break
                tries[d] += 1
                r = seq[t + d]
                if r < k:
                    hits[d][r] += 1
                if r != 0:
                    break
    table = []
    for d in range(max_depth):
        n = tries[d]
        if n == 0:  # no evidence this deep: assume it as good as the deepest measured depth
            table.append(table[-1] if table else [0.0] * k)
        else:
            table.append([h / n for h in hits[d]])
    return table


@dataclass(frozen=True)
class TreeShape:
    """parents[i] (-1: the root) and ranks[i] of each node; nodes come after their parents."""

    parents: tuple[int, ...]
    ranks: tuple[int, ...]
    expected: float  # estimated accepted tokens per verification

    @property
    def depth(self) -> int:
        depth = [0] * len(self.parents)
        for i, p in enumerate(self.parents):
            depth[i] = 1 if p < 0 else depth[p] + 1
        return max(depth, default=0)

    def levels(self) -> list[list[int]]:
        out: list[list[int]] = []
        depth = {}
        for i, p in enumerate(self.parents):
            depth[i] = 1 if p < 0 else depth[p] + 1
            while len(out) < depth[i]:
                out.append([])
            out[depth[i] - 1].append(i)
        return out


def build_tree(acc: list[list[float]], width: int) -> TreeShape:
    """Greedy: add the candidate node with the highest estimated acceptance, one at a time."""
    k, max_depth = len(acc[0]), len(acc)
    parents, ranks, values = [], [], []
    heap = [(-acc[0][r], r, -1, 1) for r in range(k)]  # (-value, rank, parent, depth)
    heapq.heapify(heap)
    while heap and len(parents) < width:
        neg, r, parent, d = heapq.heappop(heap)
        parents.append(parent)
        ranks.append(r)
        values.append(-neg)
        i = len(parents) - 1
        if d < max_depth:
            for r2 in range(k):
                heapq.heappush(heap, (neg * acc[d][r2], r2, i, d + 1))
    return TreeShape(tuple(parents), tuple(ranks), sum(values))


def throughput(shape: TreeShape, draft_s: float, verify_s: float) -> float:
    return (shape.expected + 1.0) / (draft_s + verify_s)


def choose(
    acc: list[list[float]],
    step_s: float,
    verify_s: dict[tuple[int, str], float],
    draft_level_s: dict[int, float],
    widths=WIDTHS,
) -> list[dict]:
    """Every (width, partition) candidate with its estimated tokens/s, best first.

    verify_s[(rows, partition)]: one verification of `rows` rows; draft_level_s[m]: one draft forward
    of m rows (a tree level); step_s: a plain target step."""
    rows = [
        {
            "width": 0,
            "partition": "none",
            "expected": 0.0,
            "draft_s": 0.0,
            "verify_s": step_s,
            "tokens_per_s": 1.0 / step_s,
        }
    ]
    partitions = sorted({p for _, p in verify_s})
    for w in widths:
        shape = build_tree(acc, w)
        draft = 0.0
        for level in shape.levels()[:-1]:  # the last level's nodes are leaves: never fed to the draft
            m = len(level)
            draft += draft_level_s.get(m) or interpolate(draft_level_s, m)
        draft += draft_level_s.get(1, 0.0)  # the root itself
        for p in partitions:
            v = verify_s.get((w + 1, p)) or interpolate({r: t for (r, q), t in verify_s.items() if q == p}, w + 1)
            rows.append(
                {
                    "width": w,
                    "partition": p,
                    "expected": round(shape.expected, 3),
                    "draft_s": round(draft, 5),
                    "verify_s": round(v, 5),
                    "tokens_per_s": round(throughput(shape, draft, v), 3),
                    "tree": {"parents": list(shape.parents), "ranks": list(shape.ranks)},
                }
            )
    return sorted(rows, key=lambda r: -r["tokens_per_s"])


def interpolate(points: dict[int, float], x: float) -> float:
    """Piecewise-linear in x between measured points: flat below the first; past the last, the last two
    points' slope (never falling), or in proportion to x where only one point is known."""
    xs = sorted(points)
    if not xs:
        return 0.0
    if x <= xs[0]:
        return points[xs[0]]
    for a, b in zip(xs, xs[1:]):
        if a <= x <= b:
            return points[a] + (points[b] - points[a]) * (x - a) / (b - a)
    if len(xs) == 1:
        return points[xs[0]] * x / xs[0]
    a, b = xs[-2], xs[-1]
    return points[b] + max(0.0, (points[b] - points[a]) / (b - a)) * (x - b)
