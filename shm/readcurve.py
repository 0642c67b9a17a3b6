"""This machine's read curve: direct-read throughput by read size, many reads in flight (LLM in a flash §2.2).

Small random reads pay a latency to first byte that large ones amortise; with enough of them in flight the
device overlaps them. `measure` reads a file at random 4 KiB-aligned offsets, in reads of each size, through
`DirectReader.read_ranges` (the reader that loads neuron bundles), after dropping the file from the page
cache, and gives GB/s and reads per second per size. `flash/costmodel.py` prices reads with it.
"""

from __future__ import annotations

import mmap
import random

from shm.dio import ALIGN, DirectReader, evict_page_cache

KiB, MiB = 1 << 10, 1 << 20
SIZES = tuple(4 * KiB << i for i in range(11))  # 4 KiB .. 4 MiB


def measure(
    path,
    sizes=SIZES,
    threads: int = 32,
    cell_bytes: int = 128 * MiB,
    max_reads: int = 4000,
    rounds: int = 3,
    seed: int = 0,
) -> list[dict]:
    """One row per read size: {"bytes", "reads", "seconds", "gbps", "iops", "direct"}, the median of `rounds`
    rounds over every size (interleaved: a disk's slow moment touches every size alike). Each cell reads
    about `cell_bytes` (at most `max_reads` reads, at least 16) at distinct random offsets of `path`."""
    with open(path, "rb") as f:
        size = f.seek(0, 2)
    for s in sizes:
        if s % ALIGN or s > size:
            raise ValueError(f"read size {s} must be a multiple of {ALIGN} and fit in {path} ({size} bytes)")
    rng = random.Random(seed)
    cells: dict[int, list[dict]] = {s: [] for s in sizes}
    with DirectReader(path, threads=threads) as reader:
        for _ in range(rounds):
            for s in sizes:
                cells[s].append(_cell(reader, path, size, s, max(16, min(max_reads, cell_bytes // s)), rng))
    evict_page_cache([path])
    return [sorted(c, key=lambda r: r["gbps"])[len(c) // 2] for c in cells.values()]


def _cell(reader: DirectReader, path, size: int, s: int, n: int, rng: random.Random) -> dict:
    slots = (size - s) // ALIGN + 1
    offs = [k * ALIGN for k in rng.sample(range(slots), min(n, slots))]
    dest = mmap.mmap(-1, len(offs) * s)
    try:
        dest.write(b"\0" * len(dest))  # faulted in now: the time is the disk's, not the page allocator's
        evict_page_cache([path])
        st = reader.read_ranges([(o, s, i * s) for i, o in enumerate(offs)], dest)
    finally:
        dest.close()
    return {
        "bytes": s,
        "reads": len(offs),
        "seconds": round(st.seconds, 6),
        "gbps": round(st.gbps, 4),
        "iops": round(len(offs) / st.seconds, 1) if st.seconds > 0 else 0.0,
        "direct": st.direct,
    }
