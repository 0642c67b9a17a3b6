"""The memory ledger: what the run plans to hold, and what each process holds now.

Plan: named lines (role weights, KV, the arena, ...) that must sum to at most the budget;
`plan` refuses, naming the shortfall and the largest lines, when they cannot. Live, per actor, from
/proc/<pid>/smaps_rollup on a background thread (a sample of a torch-sized process takes the kernel
milliseconds, too long for the scheduler's loop): USS (pages only this process holds), PSS (its fair
share of shared pages, e.g. the arena) and, of the PSS, what it holds: anonymous and shared memory,
the mapped files' pages aside. Those (libtorch's code, mostly) are the page cache's: a memory cgroup
reclaims them down to what the plan leaves for code pages, so outside one the PSS runs above a budget
the run keeps. The monitor, the trace's memory counter and the run's last line show the held figure.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import psutil

from common.errors import CadenceError


class BudgetError(CadenceError):
    """A memory plan that does not fit the budget."""


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


@dataclass(frozen=True)
class Plan:
    lines: tuple[tuple[str, int], ...]  # (what, bytes), in the order given
    budget: int

    @property
    def total(self) -> int:
        return sum(n for _, n in self.lines)

    @property
    def headroom(self) -> int:
        return self.budget - self.total

    def report(self) -> str:
        rows = [f"  {what:<24} {fmt_bytes(n):>12}" for what, n in self.lines]
        rows.append(f"  {'total':<24} {fmt_bytes(self.total):>12} of {fmt_bytes(self.budget)} budget")
        return "\n".join(rows)


def rollup(pid: int | str = "self") -> dict[str, int]:
    """/proc/<pid>/smaps_rollup in bytes (Linux 4.14+): Rss, Pss, Pss_Anon, Pss_Shmem, ...; {} for a process gone."""
    out = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3 and parts[0].endswith(":") and parts[1].isdigit():
                    out[parts[0][:-1]] = int(parts[1]) * 1024
    except OSError:
        pass
    return out


def held(r: dict[str, int]) -> int:
    """Of a rollup's PSS, the anonymous and shared memory (before Linux 5.9's Pss_Anon: all of the PSS, the high side)."""
    return r["Pss_Anon"] + r.get("Pss_Shmem", 0) if "Pss_Anon" in r else r.get("Pss", 0)


@dataclass(frozen=True)
class Usage:
    role: str
    pid: int
    uss: int
    pss: int
    rss: int
    held: int  # of the PSS, anonymous and shared memory: what the plan bounds (mapped files' pages aside)


class MemoryLedger:
    def __init__(self, budget_bytes: int):
        if budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be > 0, got {budget_bytes}")
        self.budget = budget_bytes
        self.plan_: Plan | None = None
        self.last: dict[str, Usage] = {}
        self.samples = 0  # how many samples `last` has seen
        self._watched: dict[str, int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def plan(self, role_bytes: dict[str, int], arena_bytes: int, extra: dict[str, int] | None = None) -> Plan:
        """Check that the per-role plan plus the arena fits the budget; raise BudgetError if not."""
        lines = [(role, int(n)) for role, n in role_bytes.items()]
        lines.append(("shared arena", int(arena_bytes)))
        lines += [(what, int(n)) for what, n in (extra or {}).items()]
        plan = Plan(tuple(lines), self.budget)
        if plan.headroom < 0:
            biggest = ", ".join(f"{w} {fmt_bytes(n)}" for w, n in sorted(lines, key=lambda x: -x[1])[:3])
            raise BudgetError(
                f"the memory plan needs {fmt_bytes(plan.total)} but memory.budget_bytes is {fmt_bytes(self.budget)} "
                f"(short by {fmt_bytes(-plan.headroom)}; largest: {biggest}); raise memory.budget_bytes "
                f"or shrink memory.arena_bytes / memory.role_bytes"
            )
        self.plan_ = plan
        return plan

    def sample(self, pids: dict[str, int]) -> dict[str, Usage]:
        """USS/PSS/RSS of each role's process now (its children included, unless they are roles of their
        own: the scheduler's children are the actors, counted once each). Vanished processes are skipped."""
        out = {}
        watched = set(pids.values())
        for role, pid in pids.items():
            try:
                procs = [psutil.Process(pid)]
                procs += [c for c in procs[0].children(recursive=True) if c.pid not in watched]
            except psutil.Error:
                continue
            rolls = [r for p in procs if (r := rollup(p.pid))]  # those gone since are skipped
            if rolls:
                uss = sum(r.get("Private_Clean", 0) + r.get("Private_Dirty", 0) for r in rolls)
                out[role] = Usage(
                    role,
                    pid,
                    uss,
                    sum(r.get("Pss", 0) for r in rolls),
                    sum(r.get("Rss", 0) for r in rolls),
                    sum(held(r) for r in rolls),
                )
        self.last = out
        self.samples += 1
        return out

    def watch(self, role: str, pid: int) -> None:
        with self._lock:
            self._watched[role] = pid

    def unwatch(self, role: str) -> None:
        with self._lock:
            self._watched.pop(role, None)

    def threads(self) -> list:
        """The sampling thread, while it runs."""
        return [self._thread] if self._thread is not None else []

    def start_sampling(self, every_s: float) -> None:
        """Sample the watched processes now and every `every_s` seconds, off the caller's thread."""

        def loop():
            while True:
                with self._lock:
                    pids = dict(self._watched)
                self.sample(pids)
                if self._stop.wait(every_s):
                    return

        self._thread = threading.Thread(target=loop, name="memory-ledger", daemon=True)
        self._thread.start()

    def stop_sampling(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)

    def pss_total(self) -> int:
        return sum(u.pss for u in self.last.values())

    def held_total(self) -> int:
        return sum(u.held for u in self.last.values())

    def report(self) -> str:
        rows = [
            f"  {u.role:<12} pid {u.pid:<8} uss {fmt_bytes(u.uss):>11}  pss {fmt_bytes(u.pss):>11}"
            f"  held {fmt_bytes(u.held):>11}"
            for u in self.last.values()
        ]
        rows.append(
            f"  {'total':<12} {'':<12} {'':>15}  pss {fmt_bytes(self.pss_total()):>11}"
            f"  held {fmt_bytes(self.held_total()):>11} of {fmt_bytes(self.budget)} budget"
        )
        return "\n".join(rows)
