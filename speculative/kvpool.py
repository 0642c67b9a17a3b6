"""The KV caches of a batch's generations in one pool (issue 42, item 3; vLLM's and llama.cpp's unified caches do
the same in pages and cells): the target's caches of every slot live in one arena of the plan's slots' bytes, and a
generation takes the rows it needs, not a fixed share each. A short request leaves room for a long one; a prompt
longer than a slot's share runs when the others leave it room, and waits (`place` says None) until they do.

Each cache is a contiguous range of the arena (the kernels read a cache's rows as one array). A slot keeps its last
range after its generation ends, so the next prompt of a conversation there finds its prefix (`Placed.kept`); an
idle slot's range goes when a new generation needs its room. The arena itself lives with the target's verifier
(speculative/verify.py `LocalBatch`, actors/verifier.py): it gets each range's offset with the generation's start.

Torch-free: the scheduler process decides where each cache goes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple


class Placed(NamedTuple):
    """Where a generation's cache goes: its first element in the arena, its rows, the arena's elements, and whether
    it is the range the slot held before, untouched since (its prefix may be reused)."""

    offset: int
    capacity: int
    total: int
    kept: bool


@dataclass
class _Range:
    offset: int
    size: int  # elements
    capacity: int  # rows
    live: bool  # a generation runs in it (else the slot's last one, kept for its prefix)


class KVPool:
    def __init__(self, total: int, size: Callable[[int], int], slots: int = 1):
        """`total`: the arena's elements; `size(capacity)`: the elements of a cache of that many rows (a sliding-window
        layer's rows stop growing at its window, so sizes are not proportional); `slots`: the generations at once,
        each with a home range of the arena's `slots`-th part where a generation of a share's rows goes."""
        self.total, self.size, self.share = total, size, total // max(1, slots)
        self.ranges: dict[int, _Range] = {}  # slot -> its range
        lo, hi = 1, 1 << 24  # the most rows one cache can hold: the whole arena's
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if size(mid) <= total else (lo, mid - 1)
        self.most = lo

    def place(self, slot: int, capacity: int) -> Placed | None:
        """A range for slot's next generation, of `capacity` rows: the slot's own last range where it holds them,
        else the slot's home where nothing else lies (generations of a share each never fragment the arena), else
        the first gap that holds them, idle slots' ranges given up where none is wide enough. None: the live
        generations leave no such room now (the caller waits for one to end)."""
        need = self.size(capacity)
        own = self.ranges.get(slot)
        if own is not None and own.size >= need and not own.live:
            own.live = True
            return Placed(own.offset, own.capacity, self.total, True)
        idle = sorted((r.size, s) for s, r in self.ranges.items() if not r.live and s != slot)
        others = {s: r for s, r in self.ranges.items() if s != slot}
        home = slot * self.share
        at = home if home + need <= self.total and not any(_overlap(r, home, need) for r in others.values()) else None
        while at is None and (at := self._gap(others.values(), need)) is None:
            if not idle:
                return None
            others.pop(idle.pop()[1])  # the widest idle range first
        self.ranges = {**others, slot: _Range(at, need, capacity, True)}
        return Placed(at, capacity, self.total, False)

    def end(self, slot: int) -> None:
        """Slot's generation ended: its range is kept (idle) for the next prompt there."""
        if slot in self.ranges:
            self.ranges[slot].live = False

    def drop(self, slot: int) -> None:
        """Slot's cache is gone (its generation cancelled): its range is free."""
        self.ranges.pop(slot, None)

    def _gap(self, ranges, need: int) -> int | None:
        """The first offset where `need` elements fit between the ranges."""
        at = 0
        for r in sorted(ranges, key=lambda r: r.offset):
            if r.offset - at >= need:
                return at
            at = max(at, r.offset + r.size)
        return at if self.total - at >= need else None


def _overlap(r: _Range, at: int, size: int) -> bool:
    return r.offset < at + size and at < r.offset + r.size


class SlotTexts:
    """The text each slot's cache holds after its last generation, and which slot a new prompt goes to: the one whose
    cache shares the longest prefix with it (a conversation's next turn, the same prompt again, a shared system
    prompt), where that prefix is at least half the prompt or SHARED tokens; else one never used, else the one used
    least recently, so that the other slots keep their conversations' prefixes for their next turns (llama-server's
    slot similarity does the same; the verifier reuses whatever prefix the slot's cache shares with the prompt)."""

    SHARED = 32  # a prefix this long is worth taking a slot for, whatever the prompt's length

    def __init__(self):
        self.kept: dict[int, list[int]] = {}  # slot -> its last generation's text (its last token not in the cache)
        self.used: dict[int, int] = {}  # slot -> when its last generation ended (a count of generations)

    def choose(self, free: list[int], prompt_ids: list[int]) -> int | None:
        """The slot among `free` for the prompt (None: no slot is free)."""

        def rank(s: int) -> tuple:
            kept = self.kept.get(s, [])[:-1]  # the cache holds the text but its last token
            n = next((i for i, (a, b) in enumerate(zip(kept, prompt_ids)) if a != b), min(len(kept), len(prompt_ids)))
            n = min(n, len(prompt_ids) - 1)  # the prompt's last token runs again
            shares = n > 0 and (2 * n >= len(prompt_ids) or n >= self.SHARED)
            return (shares, n if shares else 0, s not in self.used, -self.used.get(s, 0))

        return max(free, key=rank, default=None)

    def ended(self, slot: int, text: list[int]) -> None:
        self.kept[slot] = text
        self.used[slot] = max(self.used.values(), default=0) + 1

    def dropped(self, slot: int) -> None:
        """Slot's cache went (a generation cancelled or failed)."""
        self.kept.pop(slot, None)
