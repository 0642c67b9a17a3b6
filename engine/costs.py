"""What a forward costs on this machine, measured once per store and kernel build and cached under
$CADENCE_HOME/calibration: the price list `--draft auto` chooses with under a memory budget.

A child process (it imports torch; the scheduler never does) reads one target layer and one part of
its output head and times their linear work at each verification width, likewise one layer of the
draft, and reads a stretch of the store with direct I/O for the disk's rate. From these, a streamed
forward of `rows` rows costs about max(compute, bytes read / disk rate): the loader reads while the
verifier computes.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from common.calibration import busy_reason, cached, child_json, keep, machine_load
from engine.acceptance import TOKENS_PER_VERIFICATION
from models.kernel_build import cpu_flags, cpu_model, sources_digest  # no torch
from formats.store import WeightStore
from speculative.arca import interpolate

ROWS = (1, 2, 3, 5, 9, 17, 33)  # a token, or a tree of 1..32 tokens and its root
DISK_BYTES = 256 << 20  # read to measure the disk (less if the store is smaller)
READ_PIECE = 32 << 20  # ... in pieces of about a layer's size, as the loader reads
VERSION = 4  # 3: checked before kept (figures cached by 2 may have been taken on a busy machine); 4: the target named
MAX_SPREAD = 0.50  # two measurements' compute further apart than this is not kept (quiet hosts here: up to 40%)
MAX_DISK_SPREAD = 1.0  # ... their disk rates, a factor of two (a quiet host's disk moves that much within minutes)
SPREAD_BYTES, SPREAD_S = 64 << 20, 2e-4  # ... among the figures long enough to time


@dataclass(frozen=True)
class Costs:
    disk_gbps: float  # direct reads of the store's file, large chunks, many in flight
    layer_s: dict  # rows -> one target layer's linear work (seconds)
    head_s: dict  # rows -> the whole output head's
    draft_layer_s: float  # one draft layer, one row
    draft_head_s: float  # the draft's output head, one row
    measured_at: str = ""  # when (local time)
    load: dict = field(default_factory=dict)  # the machine's load just before (common/calibration.py)
    spread: float = 0.0  # how far the two measurements' compute disagreed (the better of each figure is kept)
    disk_spread: float = 0.0  # ... and their disk rates
    kept: bool = True  # False: measured now on a machine too busy, or too noisy, to keep the figures
    refreshed: str = ""  # where a run's reads raised the disk's figure since: when, and how much they read
    target: str = ""  # the target's store (a run's forwards refresh the figures of its target: `refresh_compute`)
    compute_refreshed: str = ""  # where a run's forwards lowered the row figures since: when, by how much

    def describe(self) -> str:
        """When and how the figures were measured, for `launch plan`."""
        how = (
            f"measured {self.measured_at or 'before'}, CPU {self.load.get('cpu', 0):.0%} and disk "
            f"{self.load.get('disk', 0):.0%} busy with other work just before, two measurements {self.spread:.0%} (disk {self.disk_spread:.0%}) "
            f"apart{'' if self.kept else ', used for this run only, not kept'}"
        )
        how += f"; the disk's rate since raised by a run's reads ({self.refreshed})" if self.refreshed else ""
        how += f"; the rows' figures since lowered by a run's forwards ({self.compute_refreshed})" * bool(
            self.compute_refreshed
        )
        return f"costs: disk {self.disk_gbps:.2f} GB/s, a target layer of 9 rows {self.layer_s[9] * 1e3:.2f} ms ({how})"

    def forward_s(self, n_layers: int, rows: int, read_bytes: int) -> float:
        """A target forward of `rows` rows that reads `read_bytes` from disk meanwhile: the linear work between the
        widths measured, and past the widest (a batch's trees: 4 x 17 rows) at its last slope."""
        layer, head = ({int(k): v for k, v in t.items()} for t in (self.layer_s, self.head_s))
        compute = n_layers * interpolate(layer, rows) + interpolate(head, rows)
        return max(compute, read_bytes / (self.disk_gbps * 1e9))

    def draft_step_s(self, draft: WeightStore) -> float:
        """One draft forward of one row."""
        return draft.args.n_layers * self.draft_layer_s + self.draft_head_s

    def hidden_by_reads(self, n_layers: int, rows: int, read_bytes: int) -> tuple[float, float]:
        """(a resident forward of `rows` rows, reading `read_bytes`): the first below the second, the disk hides
        the compute, and more rows per forward cost nothing."""
        return self.forward_s(n_layers, rows, 0), read_bytes / (self.disk_gbps * 1e9)


def costs(target: WeightStore, draft: WeightStore | None, say=None, fresh: bool = False) -> Costs:
    """This machine's costs for the pair, from the cache or measured now (a few seconds, said in one line
    through `say`) and cached; `fresh`: measured again whatever is cached."""
    cmd = [sys.executable, "-m", "engine.costs", str(target.dir), str(draft.dir) if draft else ""]

    def measure() -> dict:
        load = machine_load()
        if say:
            say("measuring this machine's forward costs and disk once (a few seconds; cached)")
        got = child_json(cmd, "measuring this machine's forward costs")
        return {**got, "load": load, "measured_at": time.strftime("%Y-%m-%d %H:%M"), "target": str(target.dir)}

    why = []

    def check(got: dict) -> str | None:
        spread = got["spread"] > MAX_SPREAD and f"two measurements' compute was {got['spread']:.0%} apart"
        spread = spread or (
            got["disk_spread"] > MAX_DISK_SPREAD and f"two disk rates were {got['disk_spread']:.0%} apart"
        )
        why.extend([r for r in (busy_reason(got["load"]), spread) if r])
        return why[0] if why else None

    out = cached(
        "costs",
        _key(target, draft),
        measure,
        lambda d: Costs(**{**d, "layer_s": _rows(d["layer_s"]), "head_s": _rows(d["head_s"])}),
        check,
        fresh,
    )
    if why:
        if say:
            say(
                f"this machine's costs were measured while {why[0]}: used for this run, not kept (measured again next time)"
            )
        return replace(out, kept=False)
    return out


REFRESH_BYTES = 1 << 30  # a run's reads long enough to speak for the disk
REFRESH_GAIN = 1.25  # ... and this much faster than a kept figure: that figure was taken on a busy disk


def refresh_disk(nbytes: int, seconds: float, say=None) -> list[Path]:
    """A run's loader read `nbytes` in `seconds` of reading (direct reads, a layer group at a time, as the
    calibration reads; reads in flight together count their time twice, so the rate is a floor). Where that is
    well above a disk rate kept on this machine (measured while the disk was busy), the kept figure takes it, said
    in one line, and later plans price the disk as it reads. A slower run changes nothing: its reads shared the
    disk with its own verifier, and perhaps with a neighbour. The files changed."""
    from common import paths

    if nbytes < REFRESH_BYTES or seconds <= 0:
        return []
    gbps, changed, was = nbytes / seconds / 1e9, [], []
    for path in sorted((paths.home() / "calibration").glob("costs-*.json")):
        try:
            kept = json.loads(path.read_text())
            if gbps < REFRESH_GAIN * kept["disk_gbps"]:
                continue
            before = kept["disk_gbps"]
            kept.update(disk_gbps=gbps, refreshed=f"{time.strftime('%Y-%m-%d %H:%M')}, {nbytes / 2**30:.1f} GiB read")
            keep(path, kept)
        except (OSError, ValueError, KeyError, TypeError):
            continue
        changed.append(path)
        was.append(before)
    if changed and say:
        say(
            f"this run read the disk at {gbps:.2f} GB/s, faster than the {min(was):.2f} GB/s kept for it: the plans "
            "that follow price it so"
        )
    return changed


REFRESH_FORWARDS = 16  # a run's target forwards enough to speak for the compute (noise only slows a forward)


@dataclass
class Forwards:
    """A run's target forwards, as its generations counted them (engine/runner.py): those of one row (plain steps, a
    target-only run's decode), the verifications and their rows together, and the seconds all took."""

    plain: int = 0
    verifications: int = 0
    rows: int = 0
    seconds: float = 0.0

    def add(self, stats: dict, new_tokens: int, decode_s: float) -> None:
        """A generation's: a speculative one's verifications and plain steps (its `stats`, common/settings.py
        SpecStats.as_dict), else a forward a token after the prompt's in its `decode_s`."""
        v, plain = stats.get("verifications", 0), stats.get("plain_steps", 0)
        if v or plain:
            self.plain, self.verifications = self.plain + plain, self.verifications + v
            self.rows += v + stats.get("drafted", 0)
            self.seconds += stats.get("verify_s", 0.0)
        elif new_tokens > 1 and decode_s > 0:
            self.plain, self.seconds = self.plain + new_tokens - 1, self.seconds + decode_s

    @property
    def count(self) -> int:
        return self.plain + self.verifications


def refresh_compute(target: WeightStore, ran: Forwards, say=None) -> list[Path]:
    """A run's target forwards (`ran`) took so many seconds, attention, the calls between processes and any wait
    for the disk included: never less than their linear work. Where the figures kept for `target` price that linear
    work alone at REFRESH_GAIN times or more what the whole forwards took, the figures were measured on a busy
    machine: each width's (a target layer's and the head's) scaled down to what the run measured, said in one line,
    and the plans that follow price the compute so (a wider tree, the draft). A run at or above the kept figures
    changes nothing: its forwards do more than the linear work. The files changed."""
    from common import paths

    if ran.count < REFRESH_FORWARDS or ran.seconds <= 0:
        return []
    changed, factors = [], []
    for path in sorted((paths.home() / "calibration").glob("costs-*.json")):
        try:
            kept = json.loads(path.read_text())
            if kept.get("target") != str(target.dir):
                continue
            c = Costs(**{**kept, "layer_s": _rows(kept["layer_s"]), "head_s": _rows(kept["head_s"])})
            n = target.args.n_layers
            priced = ran.plain * c.forward_s(n, 1, 0)
            if ran.verifications:
                priced += ran.verifications * c.forward_s(n, ran.rows / ran.verifications, 0)
            if ran.seconds * REFRESH_GAIN > priced:
                continue
            f = ran.seconds / priced
            scaled = {k: {r: t * f for r, t in kept[k].items()} for k in ("layer_s", "head_s")}
            when = f"{time.strftime('%Y-%m-%d %H:%M')}, {ran.count} forwards {1 / f:.1f}x faster"
            keep(path, {**kept, **scaled, "compute_refreshed": when})
        except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
            continue
        changed.append(path)
        factors.append(f)
    if changed and say:
        say(
            f"this run's target forwards took {ran.seconds / ran.count * 1e3:.1f} ms each, whole, where the figures "
            f"kept for them priced their linear work alone {1 / max(factors):.1f}x that: they were measured on a busy "
            "machine, and the plans that follow price the compute as this run measured it"
        )
    return changed


def _rows(t: dict) -> dict:
    return {int(k): v for k, v in t.items()}


def _key(target: WeightStore, draft: WeightStore | None) -> str:
    """The stores, the machine and the kernels' sources: what the measurement depends on."""
    machine = f"{cpu_model()} {' '.join(sorted(cpu_flags()))} {sources_digest()}"
    return hashlib.sha256(f"{VERSION} {target.dir} {draft.dir if draft else ''} {machine}".encode()).hexdigest()[:16]


def measure(target: WeightStore, draft: WeightStore | None) -> Costs:
    """In this process (it loads torch and one layer of each model)."""
    import torch

    from common.timing import best_time
    from formats.weights import StreamingWeights
    from shm.dio import DirectReader

    torch.set_num_threads(max(1, torch.get_num_threads()))
    w = StreamingWeights(target, {"layer.0", target.head_groups()[0]})
    parts = len(target.head_groups())
    layer, head = w.layer(0), w.head_part(0)
    a = target.args
    layer_s, head_s = {}, {}
    for rows in ROWS:
        x, h = torch.randn(rows, a.dim), torch.randn(rows, a.ffn_dim)
        layer_s[rows] = best_time(lambda: _layer(layer, x, h, a))
        head_s[rows] = parts * best_time(lambda: head.out.matmul(x))
    draft_layer = draft_head = 0.0
    if draft is not None:
        d = StreamingWeights(draft, {"layer.0", draft.head_groups()[0]})
        x, h = torch.randn(1, draft.args.dim), torch.randn(1, draft.args.ffn_dim)
        draft_layer = best_time(lambda: _layer(d.layer(0), x, h, draft.args))
        draft_head = len(draft.head_groups()) * best_time(lambda: d.head_part(0).out.matmul(x))
    with DirectReader(target.path) as reader:  # in pieces of a layer's size into one buffer: little memory
        n = (
            min(DISK_BYTES, target.path.stat().st_size) // READ_PIECE * READ_PIECE
            or target.path.stat().st_size // 4096 * 4096
        )
        piece = min(READ_PIECE, n)
        buf, t = torch.empty(piece, dtype=torch.uint8).numpy(), time.perf_counter()
        for at in range(0, n, piece):
            reader.read_into(at, piece, buf)
        gbps = n / (time.perf_counter() - t) / 1e9
    return Costs(gbps, layer_s, head_s, draft_layer, draft_head)


def _layer(w, x, h, a) -> None:
    import torch

    w.qkv.matmul(x)
    w.attn_out.matmul(torch.zeros(x.shape[0], a.q_dim))
    w.gate_up.matmul(x)
    w.down.matmul(h)


def draft_pays(
    costs_: Costs,
    target: WeightStore,
    draft: WeightStore,
    read_with: int,
    read_without: int,
    width: int,
    tokens_per_verification: float = TOKENS_PER_VERIFICATION,
    tokens_without: float = 1.0,
    shape: tuple[float, float] | None = None,
) -> bool:
    """Whether the draft, which leaves `read_with` bytes to read per target forward where the target alone
    reads `read_without`, should give more tokens per second: a verification of `width` draft tokens (and a
    draft forward per level of the tree; `shape`: the rows and draft forwards measured instead) writing
    `tokens_per_verification`, against a forward of the target alone writing `tokens_without` (the trie's
    guesses: engine/acceptance.py, where measured here)."""
    n = target.args.n_layers
    rows, depth = shape or (width + 1, max(1, width // 2))
    plain = costs_.forward_s(n, 1, read_without)
    tree = costs_.forward_s(n, max(1, round(rows)), read_with) + depth * costs_.draft_step_s(draft)
    return tree / tokens_per_verification < plain / tokens_without


def repeated(target: WeightStore, draft: WeightStore | None) -> dict:
    """Three measurements, the best figure of each kept, and how far apart the last two were (the first warms the
    process up): a 9-row layer and the head where they take long enough (SPREAD_S), and apart from them the disk's
    rate where the store gives a read long enough to time (SPREAD_BYTES); a tiny model's microseconds are all noise
    and price nothing."""
    runs = [measure(target, draft) for _ in range(3)]
    a, b = runs[1:]
    apart = lambda x, y: abs(x - y) / max(min(x, y), 1e-12)  # noqa: E731
    pairs = [(a.layer_s[9], b.layer_s[9]), (a.head_s[9], b.head_s[9])]
    pairs = [(x, y) for x, y in pairs if min(x, y) >= SPREAD_S]
    disk = apart(a.disk_gbps, b.disk_gbps) if target.path.stat().st_size >= SPREAD_BYTES else 0.0
    best = lambda f: {r: min(getattr(c, f)[r] for c in runs) for r in getattr(a, f)}  # noqa: E731
    c = Costs(
        max(c.disk_gbps for c in runs),
        best("layer_s"),
        best("head_s"),
        min(c.draft_layer_s for c in runs),
        min(c.draft_head_s for c in runs),
        spread=round(max([apart(x, y) for x, y in pairs] or [0.0]), 3),
        disk_spread=round(disk, 3),
    )
    return asdict(c)


def main(argv: list[str]) -> int:
    target = WeightStore(Path(argv[0]))
    draft = WeightStore(Path(argv[1])) if len(argv) > 1 and argv[1] else None
    print(json.dumps(repeated(target, draft)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
