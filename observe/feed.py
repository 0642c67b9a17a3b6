"""Where the monitor's numbers come from: `MonitorFeed` turns what the run reports into
`MonitorState` snapshots.

- the scheduler's events (`Runtime.add_listener`): a loader reply's `bytes` ->
  disk GB/s; actor deaths -> a note;
- its actor table (`Runtime.actor_status`): pid, handshake state, current op and for how long;
- the memory ledger: live USS per process and PSS of all (its sampling thread), and the plan's
  lines, which split the budget bar (or `memory_parts()` when the run knows better);
- CPU % per process (psutil, between snapshots);
- the generation's chunks (`on_chunk`: tokens, accepted length, alpha, text), `on_disk_bytes`.

Callbacks run on the run's thread and `snapshot` on the monitor's; one lock keeps them apart.
Without a scheduler (generation in this process) the feed samples this process on its own ledger.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter, deque
from typing import Callable

import psutil

from observe.state import ActorRow, MemoryPart, MonitorState
from scheduler.events import DeadEvent, ReplyEvent
from scheduler.ledger import MemoryLedger


def _rate(events: deque, now: float, window_s: float, since: float) -> float:
    """Sum per second of the (t, amount) events in the last `window_s` (or since `since`)."""
    while events and events[0][0] < now - window_s:
        events.popleft()
    span = min(window_s, now - since)
    return sum(n for _, n in events) / span if events and span > 0 else 0.0


class MonitorFeed:
    """What the run reports, as `MonitorState` snapshots. Callbacks run on the run's thread,
    `snapshot` on the monitor's; a lock keeps them apart (and costs the run ~a microsecond)."""

    def __init__(
        self,
        sched=None,
        *,
        budget_bytes: int | None = None,
        title: str = "",
        memory_parts: Callable[[], list[MemoryPart]] | None = None,
        window_s: float = 3.0,
        text_chars: int = 4000,
        alpha_points: int = 240,
        sample_s: float = 5.0,
        experts: Callable[[], tuple[int, int, int]] | None = None,
    ):
        """`experts`: a mixture of experts' buffer totals (hits, misses, bytes read), e.g. `ExpertCache.totals`."""
        self.sched = sched
        self.title = title or (f"run {sched.run_id}" if sched is not None else "")
        self.memory_parts = memory_parts
        self.experts = experts
        self.window_s = window_s
        self.t0 = time.monotonic()
        self.tokens = 0
        self._lock = threading.Lock()
        self._token_ev: deque = deque()
        self._disk_ev: deque = deque()
        self._hist: Counter = Counter()
        self._alpha: deque = deque(maxlen=alpha_points)
        self._text: deque = deque()
        self._text_len, self._text_chars = 0, text_chars
        self._notes: list[str] = []
        self._procs: dict[int, psutil.Process] = {}
        self._cpu_at: dict[int, tuple[float, float | None]] = {}  # pid -> (when read, the figure then)
        self._own_ledger = None
        if sched is not None:
            self.ledger = sched.ledger
            sched.add_listener(self.on_event)
        else:  # in-process run: sample our own process, as the scheduler's ledger would (a USS sample
            # of a torch-sized process costs the kernel milliseconds, hence every 5 s)
            self.ledger = self._own_ledger = MemoryLedger(budget_bytes or psutil.virtual_memory().total)
            self.ledger.watch("main", os.getpid())
            self.ledger.start_sampling(sample_s)

    # -- callbacks from the run ----------------------------------------------------------------

    def on_tokens(self, n: int, accepted: int | None = None, alpha: float | None = None) -> None:
        """`n` tokens were generated; `accepted`: the draft tokens the verification accepted (None if
        no verification produced them, e.g. the prefill's token); `alpha`: the threshold now."""
        now = time.monotonic()
        with self._lock:
            self.tokens += n
            self._token_ev.append((now, n))
            if len(self._token_ev) > 4096:
                self._token_ev.popleft()
            if accepted is not None:
                self._hist[accepted] += 1
            if alpha is not None:
                self._alpha.append(float(alpha))

    def on_chunk(self, chunk) -> None:
        """A generation's chunk (engine/rows.py `Chunk`): its tokens, acceptance and text."""
        self.on_tokens(len(chunk.tokens), chunk.accepted, chunk.alpha)
        if chunk.text:
            self.on_text(chunk.text)

    def on_text(self, piece: str) -> None:
        if not piece:
            return
        with self._lock:
            self._text.append(piece)
            self._text_len += len(piece)
            while self._text_len - len(self._text[0]) >= self._text_chars:
                self._text_len -= len(self._text.popleft())

    def on_disk_bytes(self, nbytes: int) -> None:
        with self._lock:
            self._disk_ev.append((time.monotonic(), nbytes))
            if len(self._disk_ev) > 4096:
                self._disk_ev.popleft()

    def on_event(self, ev) -> None:
        """The scheduler's listener: a loader reply carrying `bytes` was read from disk."""
        if type(ev) is ReplyEvent:
            if ev.role == "loader" and ev.op == "load" and ev.reply.ok:
                n = ev.reply.result.get("bytes")
                if type(n) is int:
                    self.on_disk_bytes(n)
        elif type(ev) is DeadEvent:
            with self._lock:
                self._notes.append(f"the {ev.role} actor {ev.reason}")

    # -- snapshots (the monitor's thread) --------------------------------------------------------

    def _cpu(self, pid: int) -> float | None:
        """CPU % of a process since its last reading, at most twice a second: two readings a few ms
        apart divide a tick of CPU time by almost no wall time (figures like 2608%)."""
        p = self._procs.get(pid)
        now = time.monotonic()
        try:
            if p is None:
                p = self._procs[pid] = psutil.Process(pid)
                p.cpu_percent(None)  # the first call only sets the reference point
                self._cpu_at[pid] = (now, None)
                return None
            at, last = self._cpu_at.get(pid, (0.0, None))
            if now - at < 0.5:
                return last
            pct = min(p.cpu_percent(None), 100.0 * (os.cpu_count() or 1))
            self._cpu_at[pid] = (now, pct)
            return pct
        except psutil.Error:
            return None

    def _actors(self, now: float) -> list[ActorRow]:
        last = self.ledger.last
        if self.sched is None:
            pid = os.getpid()
            u = last.get("main")
            return [ActorRow("main", pid, "running", None, None, self._cpu(pid), u.uss if u else None)]
        s = self.sched
        u = last.get("scheduler")
        rows = [ActorRow("scheduler", s.pid, "running", None, None, self._cpu(s.pid), u.uss if u else None)]
        for a in s.actor_status():
            u = last.get(a.role)
            alive = a.state != "dead"
            rows.append(
                ActorRow(
                    a.role,
                    a.pid,
                    a.state,
                    a.op,
                    now - a.op_since if a.op_since else None,
                    self._cpu(a.pid) if alive else None,
                    u.uss if u and alive else None,
                )
            )
        return rows

    def _memory(self) -> list[MemoryPart]:
        if self.memory_parts is not None:
            return list(self.memory_parts())
        plan = self.ledger.plan_
        if plan is None:
            return []
        parts = [MemoryPart(what, n) for what, n in plan.lines if what != "shared arena"]
        arena = dict(plan.lines).get("shared arena", 0)
        slots = getattr(self.sched, "stream_slots", None)
        used = slots.used_bytes if slots is not None else 0
        return parts + [MemoryPart("streaming slots", used), MemoryPart("arena", max(arena - used, 0))]

    def snapshot(self) -> MonitorState:
        now = time.monotonic()
        actors = self._actors(now)
        memory = self._memory()
        with self._lock:
            tps = _rate(self._token_ev, now, self.window_s, self.t0)
            disk = _rate(self._disk_ev, now, self.window_s, self.t0) / 1e9
            hist = tuple(sorted(self._hist.items()))
            alpha = tuple(self._alpha)
            text = "".join(self._text)
            notes = tuple(self._notes)
            tokens = self.tokens
        measured = self.ledger.held_total() if self.ledger.samples else None
        files = self.ledger.pss_total() - measured if measured is not None else None
        plan = self.ledger.plan_
        planned = self.memory_parts is not None or (
            plan is not None and any(w != "shared arena" for w, _ in plan.lines)
        )
        hit_rate = per_token = None
        if self.experts is not None:
            hits, misses, nbytes = self.experts()
            hit_rate = hits / (hits + misses) if hits + misses else 0.0
            per_token = nbytes / tokens / 1e6 if tokens else None
        return MonitorState(
            now - self.t0,
            self.title,
            tuple(actors),
            self.ledger.budget,
            tuple(memory),
            measured,
            tokens,
            tps,
            hist,
            alpha,
            disk,
            text,
            notes,
            planned,
            hit_rate,
            per_token,
            files,
        )

    def close(self) -> None:
        """Stop listening to the scheduler (and sampling, in-process). The monitors call it at stop."""
        if self.sched is not None:
            self.sched.remove_listener(self.on_event)
        if self._own_ledger is not None:
            self._own_ledger.stop_sampling()

    def threads(self) -> list:
        """The threads this feed runs: in process, its own ledger's memory sampler."""
        return self._own_ledger.threads() if self._own_ledger is not None else []
