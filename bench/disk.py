"""`python -m bench.disk FILE`: read GB/s from disk by threads x chunk size, direct vs buffered.

`--curve`: instead, the read curve the flash cost model prices reads with (shm/readcurve.py): random
direct reads of 4 KiB .. 4 MiB, `--depth` in flight, GB/s and reads per second by size, written to
$CADENCE_HOME/read-curve.json (or the path given).

Each cell reads the first `--mib` MiB of FILE (opened read-only) into one pre-faulted, page-aligned
buffer, after evicting FILE from the page cache, so every byte comes from the disk. "direct" is
`DirectReader` with O_DIRECT; "buffered+drop" is its fallback (page cache, no readahead, DONTNEED
after each chunk); "buffered" is a plain cold read through the page cache with readahead (1 MiB
reads, one thread), the usual way a file gets read. Keep it short on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import sys
import time

from shm.dio import DirectReader, evict_page_cache

MiB = 1 << 20


def _size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": MiB, "G": 1 << 30}.get(s[-1:], 1)
    return int(s.rstrip("KMG")) * mult


def _label(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n >> 10} KiB"


def plain_read(path: str, dest: mmap.mmap, nbytes: int) -> float:
    t0 = time.perf_counter()
    mv = memoryview(dest)
    with open(path, "rb", buffering=0) as f:
        got = 0
        while got < nbytes:
            n = f.readinto(mv[got : min(got + MiB, nbytes)])
            if not n:
                break
            got += n
    mv.release()
    return nbytes / (time.perf_counter() - t0) / 1e9


def read_curve(path: str, out: str, depth: int, mib: int) -> int:
    from pathlib import Path

    from flash.costmodel import ReadCurve, curve_path
    from shm.readcurve import measure

    rows = measure(path, threads=depth, cell_bytes=mib * MiB)
    print(f"random direct reads of {path}, {depth} in flight\n")
    print("| read size | GB/s | reads/s |\n| --- | ---: | ---: |")
    for r in rows:
        print(f"| {_label(r['bytes'])} | {r['gbps']:.3f} | {r['iops']:.0f} |")
    dest = Path(out) if out else curve_path()
    ReadCurve.from_rows(rows, depth).save(dest)
    print(f"\nwritten to {dest}" + ("" if rows[0]["direct"] else " (NOT direct: the file lives in memory)"))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.disk", description=__doc__.splitlines()[0])
    p.add_argument("file")
    p.add_argument("--threads", default="1,2,4,8")
    p.add_argument("--chunks", default="64K,1M,4M,16M")
    p.add_argument("--mib", type=int, default=512, help="MiB read per cell (from the start of the file)")
    p.add_argument("--modes", default="direct,drop", help="direct, drop (buffered+drop)")
    p.add_argument("--json")
    p.add_argument(
        "--curve",
        nargs="?",
        const="",
        default=None,
        metavar="OUT",
        help="measure the random-read curve instead (default OUT: $CADENCE_HOME/read-curve.json)",
    )
    p.add_argument("--depth", type=int, default=32, help="--curve: reads in flight")
    a = p.parse_args(argv)
    if a.curve is not None:
        return read_curve(a.file, a.curve, a.depth, a.mib)
    threads = [int(t) for t in a.threads.split(",")]
    chunks = [_size(c) for c in a.chunks.split(",")]
    nbytes = min(a.mib * MiB, os.path.getsize(a.file)) // 4096 * 4096
    dest = mmap.mmap(-1, nbytes)
    dest.write(b"\0" * nbytes)  # fault the pages in now: the arena's are, too
    rows = []
    for how in [m for m in a.modes.split(",") if m]:
        for t in threads:
            for c in chunks:
                evict_page_cache([a.file])
                with DirectReader(a.file, threads=t, chunk_bytes=c, direct=how == "direct") as r:
                    st = r.read_into(0, nbytes, dest)
                rows.append(
                    {
                        "mode": "direct" if how == "direct" else "buffered+drop",
                        "threads": t,
                        "chunk": c,
                        "gbps": round(st.gbps, 3),
                    }
                )
                print(f"{rows[-1]['mode']:>14} threads {t} chunk {_label(c):>7}: {st.gbps:.2f} GB/s", file=sys.stderr)
    evict_page_cache([a.file])
    rows.append({"mode": "buffered", "threads": 1, "chunk": MiB, "gbps": round(plain_read(a.file, dest, nbytes), 3)})
    evict_page_cache([a.file])
    print(
        f"{'buffered':>14} threads 1 chunk   1 MiB: {rows[-1]['gbps']:.2f} GB/s (readahead, cache kept, then evicted)",
        file=sys.stderr,
    )
    print(f"\nread {nbytes / MiB:.0f} MiB of {a.file} per cell, GB/s (1e9 B/s)\n")
    for mode in [m for m in ("direct", "buffered+drop") if any(r["mode"] == m for r in rows)]:
        print(f"| {mode} | " + " | ".join(_label(c) for c in chunks) + " |")
        print("| --- |" + " ---: |" * len(chunks))
        for t in threads:
            cells = {r["chunk"]: r["gbps"] for r in rows if r["mode"] == mode and r["threads"] == t}
            print(f"| {t} thread{'s' if t > 1 else ''} | " + " | ".join(f"{cells[c]:.2f}" for c in chunks) + " |")
        print()
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"file": a.file, "bytes": nbytes, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
