"""What the monitor draws: one frozen snapshot of the run (observe/feed.py makes them)."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ActorRow:
    role: str
    pid: int
    state: str  # the scheduler's handshake state (ready, dead, ...) or "running"
    op: str | None = None  # what it works on now; None: idle
    op_s: float | None = None  # for how long
    cpu_pct: float | None = None  # of one core, since the last snapshot
    uss: int | None = None  # bytes only this process holds (the ledger's last sample)


@dataclass(frozen=True)
class MemoryPart:
    name: str  # draft, target resident, streaming slots, KV, arena, ...
    nbytes: int


@dataclass(frozen=True)
class MonitorState:
    elapsed_s: float = 0.0
    title: str = ""
    actors: tuple[ActorRow, ...] = ()
    budget_bytes: int = 0
    memory: tuple[MemoryPart, ...] = ()  # the bar's parts, in order
    measured_bytes: int | None = None  # what every process holds now: PSS of anonymous and shared memory
    tokens: int = 0
    tokens_per_s: float = 0.0  # over the last few seconds
    accepted_hist: tuple[tuple[int, int], ...] = ()  # (accepted length, verifications)
    alpha: tuple[float, ...] = ()  # after each verification, the latest last
    disk_gbps: float = 0.0  # over the last few seconds
    text: str = ""  # the tail of the generated text
    notes: tuple[str, ...] = ()  # deaths, errors
    planned: bool = True  # a memory budget was planned (without one, only the measured memory shows)
    expert_hit_rate: float | None = None  # MoE under a budget: the share of experts asked for that were held
    expert_mb_per_token: float | None = None
    file_bytes: int | None = None  # and the PSS of their mapped files' pages (code: the page cache's, not held)

    @property
    def mean_accepted(self) -> float | None:
        n = sum(c for _, c in self.accepted_hist)
        return sum(k * c for k, c in self.accepted_hist) / n if n else None

    @property
    def experts_text(self) -> str:
        return (
            ""
            if self.expert_hit_rate is None
            else f"  experts hit {100 * self.expert_hit_rate:.0f}% read {fmt_opt(self.expert_mb_per_token, '.0f')} MB/token"
        )

    @property
    def avg_tokens_per_s(self) -> float:
        return self.tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0


def fmt_opt(v, fmt: str, none: str = "-") -> str:
    return none if v is None else format(v, fmt)


def source_of(source):
    """(a callable giving MonitorState, the feed to close at stop or None)."""
    if hasattr(source, "snapshot"):
        return source.snapshot, source
    return source, None


def snapshot_of(source, last: MonitorState) -> MonitorState:
    """A fresh snapshot; if taking it fails, the last one with the error as a note (a dead
    refresh thread would freeze the screen with no word why)."""
    if source is None:
        return last
    try:
        return source()
    except Exception as e:
        note = f"monitor: the snapshot failed: {type(e).__name__}: {e}"
        return last if note in last.notes else replace(last, notes=last.notes + (note,))
