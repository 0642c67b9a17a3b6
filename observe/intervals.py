"""Interval algebra over sorted, disjoint (start, end) lists, and the self time of nested spans."""

from __future__ import annotations


def union(iv) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(iv):
        if e <= s:
            continue
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def length(iv) -> float:
    return sum(e - s for s, e in iv)


def intersect(a, b) -> list[tuple[float, float]]:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a, b) -> list[tuple[float, float]]:
    out, j = [], 0
    for s, e in a:
        while j < len(b) and b[j][1] <= s:
            j += 1
        k, cur = j, s
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < e:
            out.append((cur, e))
    return out


def exclusive(spans) -> list[tuple[float, float, object]]:
    """Self time of nested spans on one thread: (start, end, label) of the stretches where each
    span is the innermost one. A child sticking out of its parent is cut at the parent's end."""
    out: list = []
    stack: list[list] = []  # [end, label, cursor: where its self time resumes]

    def close() -> None:
        end, label, cur = stack.pop()
        if cur < end:
            out.append((cur, end, label))
        if stack:
            stack[-1][2] = max(stack[-1][2], end)

    for s, e, label in sorted(spans, key=lambda x: (x[0], -x[1])):
        while stack and stack[-1][0] <= s:
            close()
        if stack:
            top = stack[-1]
            if top[2] < s:
                out.append((top[2], s, top[1]))
            top[2] = max(top[2], s)
            e = min(e, top[0])
        stack.append([e, label, s])
    while stack:
        close()
    return out
