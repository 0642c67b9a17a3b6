"""Slots in an arena: a first-fit allocator that never exceeds its bytes, plus leases.

A slot has one owner (whoever allocated it) and any number of leases (consumers still reading
it). `free` says the owner is done; the bytes come back only once every lease is released too,
so a slot is never handed out again while a consumer may still read it. Pure bookkeeping: no
shared memory, no processes.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass

from common.errors import CadenceError


class SlotsFull(CadenceError):
    """An allocation did not fit."""


@dataclass(frozen=True)
class Slot:
    offset: int  # bytes from the start of the arena, a multiple of the allocator's align
    nbytes: int  # rounded up to align


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


class SlotAllocator:
    """Slots within [base, base + capacity_bytes) of one arena."""

    def __init__(
        self,
        capacity_bytes: int,
        align: int = 4096,
        base: int = 0,
        name: str = "arena",
        setting: str = "the arena size",
    ):
        if align <= 0 or align & (align - 1):
            raise ValueError(f"align must be a power of two, got {align}")
        if base % align:
            raise ValueError(f"base {base} is not a multiple of align {align}")
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity = capacity_bytes // align * align
        self.align = align
        self.base = base
        self.name = name
        self.setting = setting  # what the user raises when it is full
        self._free: list[tuple[int, int]] = [(base, self.capacity)] if self.capacity else []  # sorted (offset, size)
        self._live: dict[int, Slot] = {}  # offset -> slot, allocated and not yet reclaimed
        self._offsets: list[int] = []  # sorted keys of _live
        self._leases: dict[int, Counter] = {}  # offset -> consumer -> count
        self._freed: set[int] = set()  # owner done, waiting for leases
        self.used_bytes = 0
        self.peak_bytes = 0

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used_bytes

    def largest_free(self) -> int:
        return max((size for _, size in self._free), default=0)

    def try_alloc(self, nbytes: int) -> Slot | None:
        if nbytes <= 0:
            raise ValueError(f"slot size must be > 0, got {nbytes}")
        need = (nbytes + self.align - 1) // self.align * self.align
        for i, (off, size) in enumerate(self._free):
            if size >= need:
                if size == need:
                    del self._free[i]
                else:
                    self._free[i] = (off + need, size - need)
                slot = Slot(off, need)
                self._live[off] = slot
                bisect.insort(self._offsets, off)
                self.used_bytes += need
                self.peak_bytes = max(self.peak_bytes, self.used_bytes)
                return slot
        return None

    def alloc(self, nbytes: int) -> Slot:
        slot = self.try_alloc(nbytes)
        if slot is None:
            raise SlotsFull(
                f"{self.name} cannot fit {_mib(nbytes)}: {_mib(self.free_bytes)} free of {_mib(self.capacity)} "
                f"(largest free block {_mib(self.largest_free())}, {len(self._leases)} slots still leased); "
                f"raise {self.setting} or release slots sooner"
            )
        return slot

    def _check(self, slot: Slot) -> None:
        if self._live.get(slot.offset) != slot:
            raise ValueError(f"{slot} is not an allocated slot of {self.name}")

    def slot_at(self, offset: int) -> Slot | None:
        """The live slot containing byte `offset`, if any."""
        i = bisect.bisect_right(self._offsets, offset) - 1
        if i >= 0:
            slot = self._live[self._offsets[i]]
            if offset < slot.offset + slot.nbytes:
                return slot
        return None

    def lease(self, slot: Slot, consumer: str) -> None:
        self._check(slot)
        if slot.offset in self._freed:
            raise ValueError(f"{slot} was freed; it cannot be leased to {consumer}")
        self._leases.setdefault(slot.offset, Counter())[consumer] += 1

    def release(self, slot: Slot, consumer: str) -> None:
        self._check(slot)
        held = self._leases.get(slot.offset)
        if not held or not held[consumer]:
            raise ValueError(f"{consumer} holds no lease on {slot} of {self.name}")
        held[consumer] -= 1
        if not +held:
            del self._leases[slot.offset]
            if slot.offset in self._freed:
                self._reclaim(slot)

    def leases(self, slot: Slot) -> dict[str, int]:
        return dict(+self._leases.get(slot.offset, Counter()))

    def free(self, slot: Slot) -> None:
        """Owner done. The bytes return now, or when the last lease is released."""
        self._check(slot)
        if slot.offset in self._freed:
            raise ValueError(f"{slot} of {self.name} was freed twice")
        if slot.offset in self._leases:
            self._freed.add(slot.offset)
        else:
            self._reclaim(slot)

    def _reclaim(self, slot: Slot) -> None:
        self._freed.discard(slot.offset)
        del self._live[slot.offset]
        del self._offsets[bisect.bisect_left(self._offsets, slot.offset)]
        self.used_bytes -= slot.nbytes
        off, size = slot.offset, slot.nbytes
        i = bisect.bisect_left(self._free, (off, 0))
        # coalesce with the neighbours so freed space can hold large slots again
        if i < len(self._free) and off + size == self._free[i][0]:
            size += self._free.pop(i)[1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == off:
            off, size = self._free[i - 1][0], self._free[i - 1][1] + size
            self._free[i - 1] = (off, size)
        else:
            self._free.insert(i, (off, size))
