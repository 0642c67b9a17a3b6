"""The I/O cost model of LLM in a flash (§2.2, §4.2), from this machine's read curve.

A read of s bytes, many in flight, moves at the curve's throughput for s: small reads pay their latency to
first byte, large ones stream. A layer's missing neurons are read as runs of consecutive 4 KiB blocks of the
bundle file (one read per run); two runs merge into one read through the blocks between them where the longer
read costs less than the two (§2.2: "read more than needed, in larger chunks, and discard"). The layer's whole
FFN is one contiguous read at the best large-read throughput. `choose` prices both and picks the cheaper.
The curve is measured once per machine (`machine_curve`: on first need, or `launch models read-curve`) and
kept at $CADENCE_HOME/read-curve.json; everything else here is pure functions over numbers.
"""

from __future__ import annotations

import bisect
import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common import paths
from common.errors import CadenceError

ALIGN = 4096
CURVE_FILE = "read-curve.json"


def curve_path() -> Path:
    """Where this machine's measured curve lives: $CADENCE_HOME/read-curve.json."""
    return paths.home() / CURVE_FILE


@dataclass(frozen=True)
class ReadCurve:
    """Throughput (1e9 bytes/s) of reads of each size with `threads` reads in flight; sizes ascending."""

    sizes: tuple[int, ...]
    gbps: tuple[float, ...]
    threads: int = 32

    def __post_init__(self):
        if not self.sizes or len(self.sizes) != len(self.gbps):
            raise ValueError(f"ReadCurve needs one throughput per size; got {len(self.sizes)} sizes, {len(self.gbps)}")
        if list(self.sizes) != sorted(set(self.sizes)) or self.sizes[0] <= 0 or min(self.gbps) <= 0:
            raise ValueError(f"ReadCurve sizes must ascend and throughputs be positive; got {self.sizes}, {self.gbps}")

    def throughput(self, nbytes: int) -> float:
        """Bytes/s of reads of `nbytes`: log-linear between measured sizes, flat beyond both ends."""
        s = self.sizes
        if nbytes <= s[0]:
            return self.gbps[0] * 1e9
        if nbytes >= s[-1]:
            return self.gbps[-1] * 1e9
        j = bisect.bisect_right(s, nbytes)
        t = (math.log(nbytes) - math.log(s[j - 1])) / (math.log(s[j]) - math.log(s[j - 1]))
        return (self.gbps[j - 1] + t * (self.gbps[j] - self.gbps[j - 1])) * 1e9

    def read_seconds(self, nbytes: int) -> float:
        """Share of the device's time one read of `nbytes` takes when many are in flight."""
        return nbytes / self.throughput(nbytes) if nbytes > 0 else 0.0

    def stream_seconds(self, nbytes: int) -> float:
        """One contiguous range, read in whatever piece size the curve favours (a whole layer)."""
        if nbytes <= 0:
            return 0.0
        best = max([self.throughput(nbytes)] + [g * 1e9 for s, g in zip(self.sizes, self.gbps) if s <= nbytes])
        return nbytes / best

    def seconds_table(self, unit: int, most: int) -> np.ndarray:
        """read_seconds(k * unit) for k = 0 .. most, at once (the planner looks prices up by count)."""
        return _table(self, unit, most).copy()

    def to_dict(self) -> dict:
        return {"threads": self.threads, "sizes": list(self.sizes), "gbps": list(self.gbps)}

    @classmethod
    def from_rows(cls, rows: list[dict], threads: int) -> "ReadCurve":
        """From `shm.readcurve.measure`'s rows."""
        rows = sorted(rows, key=lambda r: r["bytes"])
        return cls(tuple(int(r["bytes"]) for r in rows), tuple(float(r["gbps"]) for r in rows), threads)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1))
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path | None = None) -> "ReadCurve":
        path = Path(path or curve_path())
        measure = "measure it with `launch models read-curve`"
        try:
            d = json.loads(path.read_text())
            return cls(tuple(int(x) for x in d["sizes"]), tuple(float(x) for x in d["gbps"]), int(d["threads"]))
        except FileNotFoundError:
            raise CadenceError(f"no read curve at {path}: {measure}") from None
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CadenceError(f"the read curve {path} is damaged ({e}); {measure} again") from None


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


@functools.lru_cache(maxsize=16)
def _table(curve: ReadCurve, unit: int, most: int) -> np.ndarray:
    """read_seconds of 0 .. most units: log-linear interpolation of the throughput, flat beyond the ends."""
    size = unit * np.arange(most + 1, dtype=np.float64)
    size[0] = 1.0
    gbps = np.interp(np.log(size), np.log(np.asarray(curve.sizes, np.float64)), np.asarray(curve.gbps))
    out = size / (gbps * 1e9)
    out[0] = 0.0
    return out


def machine_curve(sample, say=None) -> ReadCurve:
    """This machine's read curve: the one kept at $CADENCE_HOME/read-curve.json, else measured now on the
    file `sample` (a weight store's weights.bin: large and on the disk the bundles live on) and kept."""
    path = curve_path()
    try:
        return ReadCurve.load(path)
    except CadenceError:
        pass
    return measure_curve(sample, path, say)


def measure_curve(sample, path: Path | None = None, say=None) -> ReadCurve:
    """Measure the read curve on the file `sample` (shm/readcurve.py) and keep it at `path`."""
    from shm.readcurve import measure

    if say:
        say(f"measuring this machine's read curve on {sample} (once; kept at {path or curve_path()})")
    size = Path(sample).stat().st_size
    sizes = tuple(s for s in _SIZES if s <= size)
    if not sizes:
        raise CadenceError(f"{sample} is too small ({size} bytes) to measure reads on; give a file of a few MiB")
    curve = ReadCurve.from_rows(measure(sample, sizes=sizes), 32)
    curve.save(Path(path or curve_path()))
    return curve


_SIZES = tuple(ALIGN << i for i in range(11))  # 4 KiB .. 4 MiB


def runs(units) -> list[tuple[int, int]]:
    """Sorted distinct indices -> runs of consecutive ones as (first, count)."""
    u = np.asarray(units, dtype=np.int64)
    if u.size == 0:
        return []
    cut = np.flatnonzero(np.diff(u) != 1) + 1
    first = u[np.concatenate([[0], cut])]
    count = np.diff(np.concatenate([[0], cut, [u.size]]))
    return list(zip(first.tolist(), count.tolist()))


def plan_reads(units, unit_bytes: int, curve: ReadCurve) -> list[tuple[int, int]]:
    """The reads that fetch `units` (sorted distinct indices of units of `unit_bytes` each, laid out back to
    back: the 4 KiB blocks of a bundle file): (first unit, units) per read, neighbouring runs merged through
    their gap wherever one read of the whole span costs less than the two."""
    rs = runs(units)
    if not rs:
        return []
    cost = _table(curve, unit_bytes, rs[-1][0] + rs[-1][1] - rs[0][0]).tolist()
    out: list[list[int]] = []
    for first, n in rs:
        if out:
            a, m = out[-1]
            span = first + n - a
            if cost[span] <= cost[m] + cost[n]:
                out[-1][1] = span
                continue
        out.append([first, n])
    return [(a, n) for a, n in out]


def reads_seconds(reads, unit_bytes: int, curve: ReadCurve) -> float:
    return sum(curve.read_seconds(n * unit_bytes) for _, n in reads)


@dataclass(frozen=True)
class Choice:
    """A layer's decision: `bundles` (read `reads`) or the whole layer's FFN; the prices of both, in seconds."""

    bundles: bool
    reads: tuple[tuple[int, int], ...]
    bundle_seconds: float
    layer_seconds: float
    bundle_bytes: int
    layer_bytes: int

    @property
    def bytes(self) -> int:
        return self.bundle_bytes if self.bundles else self.layer_bytes


def choose(units, unit_bytes: int, layer_bytes: int, curve: ReadCurve) -> Choice:
    """Price reading the units (4 KiB blocks) that hold a layer's missing neurons against reading its whole
    FFN (`layer_bytes`, contiguous); the cheaper wins (a tie goes to the bundles: they read fewer bytes)."""
    reads = tuple(plan_reads(units, unit_bytes, curve))
    b = reads_seconds(reads, unit_bytes, curve)
    w = curve.stream_seconds(layer_bytes)
    return Choice(b <= w, reads, b, w, sum(n for _, n in reads) * unit_bytes, layer_bytes)


def record_blocks(starts: np.ndarray, record_bytes: int) -> np.ndarray:
    """The sorted distinct 4 KiB blocks covering records of `record_bytes` at byte offsets `starts` (a record
    may straddle blocks)."""
    starts = np.asarray(starts, dtype=np.int64)
    first, last = starts // ALIGN, (starts + record_bytes - 1) // ALIGN
    span = int((last - first).max(initial=0)) + 1
    blocks = first[:, None] + np.arange(span)
    return np.unique(blocks[blocks <= last[:, None]])


def chunk_starts(positions: np.ndarray, record_bytes: int, chunk_neurons: int) -> np.ndarray:
    """Byte offsets, from a layer's first chunk, of the records at `positions` in a layout of chunks of
    `chunk_neurons` records, each chunk padded to whole 4 KiB blocks."""
    positions = np.asarray(positions, dtype=np.int64)
    chunk_bytes = aligned(chunk_neurons * record_bytes)
    return positions // chunk_neurons * chunk_bytes + positions % chunk_neurons * record_bytes


def best_chunk_neurons(
    curve: ReadCurve, record_bytes: int, ffn_dim: int, miss: float = 0.05, most: int = 64, trials: int = 4
) -> int:
    """The neurons per chunk the curve favours (the paper's chunk-size choice, §3.2): the least expected
    price of a layer's missing neurons (each missing with probability `miss`, independently) read as the
    reader reads them (covering blocks, merged runs) or, where cheaper, as the whole layer. One neuron a
    chunk reads a single block per neuron; packed chunks waste no padding and bring neighbours along."""
    if not 0 < miss <= 1:
        raise ValueError(f"miss is a probability in (0, 1]; got {miss}")
    rng = np.random.default_rng(0)
    sets = [np.flatnonzero(rng.random(ffn_dim) < miss) for _ in range(trials)]

    def price(c: int) -> float:
        layer = aligned(c * record_bytes) * -(-ffn_dim // c)
        total = 0.0
        for s in sets:
            ch = choose(record_blocks(chunk_starts(s, record_bytes, c), record_bytes), ALIGN, layer, curve)
            total += min(ch.bundle_seconds, ch.layer_seconds)
        return total

    prices = {c: price(c) for c in range(1, most + 1)}
    return min(prices, key=lambda c: (prices[c], c))
