"""The I/O cost model of LLM in a flash (§2.2, §4.2), from this machine's read curve.

A read of s bytes, many in flight, moves at the curve's throughput for s: small reads pay their latency to
first byte, large ones stream. A layer's missing neurons are read as runs of consecutive bundle chunks (one
read per run); two runs merge into one read through the chunks between them where the longer read costs less
than the two (§2.2: "read more than needed, in larger chunks, and discard"). The layer's whole FFN is one
contiguous read at the best large-read throughput. `choose` prices both and picks the cheaper. Pure
functions over numbers: no files but the curve's JSON, no processes.
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass
from pathlib import Path

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
        measure = "measure it with `python -m bench.disk FILE --curve` (a weight store's weights.bin will do)"
        try:
            d = json.loads(path.read_text())
            return cls(tuple(int(x) for x in d["sizes"]), tuple(float(x) for x in d["gbps"]), int(d["threads"]))
        except FileNotFoundError:
            raise CadenceError(f"no read curve at {path}: {measure}") from None
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CadenceError(f"the read curve {path} is damaged ({e}); {measure} again") from None


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def runs(chunks) -> list[tuple[int, int]]:
    """Sorted distinct chunk indices -> runs of consecutive ones as (first, count)."""
    out: list[list[int]] = []
    for c in chunks:
        if out and c == out[-1][0] + out[-1][1]:
            out[-1][1] += 1
        else:
            out.append([c, 1])
    return [(a, n) for a, n in out]


def plan_reads(chunks, chunk_bytes: int, curve: ReadCurve) -> list[tuple[int, int]]:
    """The reads that fetch `chunks` (sorted distinct indices of chunks of `chunk_bytes` each, laid out
    back to back): (first chunk, chunks) per read, neighbouring runs merged through their gap wherever one
    read of the whole span costs less than the two."""
    out: list[tuple[int, int]] = []
    for first, n in runs(chunks):
        if out:
            a, m = out[-1]
            span = first + n - a
            if curve.read_seconds(span * chunk_bytes) <= curve.read_seconds(m * chunk_bytes) + curve.read_seconds(
                n * chunk_bytes
            ):
                out[-1] = (a, span)
                continue
        out.append((first, n))
    return out


def reads_seconds(reads, chunk_bytes: int, curve: ReadCurve) -> float:
    return sum(curve.read_seconds(n * chunk_bytes) for _, n in reads)


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


def choose(chunks, chunk_bytes: int, layer_bytes: int, curve: ReadCurve) -> Choice:
    """Price reading the chunks that hold a layer's missing neurons against reading its whole FFN
    (`layer_bytes`, contiguous); the cheaper wins (a tie goes to the bundles: they read fewer bytes)."""
    reads = tuple(plan_reads(chunks, chunk_bytes, curve))
    b = reads_seconds(reads, chunk_bytes, curve)
    w = curve.stream_seconds(layer_bytes)
    return Choice(b <= w, reads, b, w, sum(n for _, n in reads) * chunk_bytes, layer_bytes)


def chunk_cost(curve: ReadCurve, record_bytes: int, neurons: int, miss: float) -> float:
    """Expected seconds per missing neuron when bundles of `neurons` records (padded to whole 4 KiB blocks)
    are read, a neuron missing with probability `miss`, independently of its neighbours."""
    size = aligned(neurons * record_bytes)
    p_read = 1.0 - (1.0 - miss) ** neurons
    return p_read * curve.read_seconds(size) / (neurons * miss)


def best_chunk_neurons(curve: ReadCurve, record_bytes: int, miss: float = 0.05, most: int = 64) -> int:
    """The neurons per chunk the curve favours for a miss rate: the paper's chunk-size choice (§3.2)."""
    if not 0 < miss <= 1:
        raise ValueError(f"miss is a probability in (0, 1]; got {miss}")
    return min(range(1, most + 1), key=lambda c: (chunk_cost(curve, record_bytes, c, miss), c))
