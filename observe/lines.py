"""The monitor where there is no terminal to draw on: `LogMonitor`, a plain line now and then on stderr
(so a piped stdout stays the generated text alone), and `NullMonitor` (--no-monitor)."""

from __future__ import annotations

import sys
import threading

from observe.state import MonitorState, fmt_opt, snapshot_of, source_of
from scheduler.ledger import fmt_bytes


class LogMonitor:
    """The plain fallback when stdout is no terminal: one line every `every_s` on `file` (stderr),
    so a piped stdout stays the generated text alone."""

    shows_text = False

    def __init__(self, source=None, file=None, every_s: float = 2.0):
        self.source, self.feed = source_of(source)
        self.file = file if file is not None else sys.stderr
        self.every_s = every_s
        self._state = MonitorState()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._emitted = False

    def __enter__(self) -> "LogMonitor":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        def loop():
            while not self._stop.wait(self.every_s):
                self._emit()

        self._thread = threading.Thread(target=loop, name="log-monitor", daemon=True)
        self._thread.start()

    def update(self, state: MonitorState | None = None) -> None:
        self._state = state if state is not None else snapshot_of(self.source, self._state)

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(2.0)
            self._thread = None
            # the closing line sums up a run that got going; a run that failed before its first
            # token ends with its error sentence alone
            self._state = snapshot_of(self.source, self._state)
            if self._state.tokens > 0 or self._emitted:
                self._emit()
        if self.feed is not None:
            self.feed.close()

    def _emit(self) -> None:
        self._state = snapshot_of(self.source, self._state)
        self._emitted = True
        print(self.line(self._state), file=self.file, flush=True)

    @staticmethod
    def line(s: MonitorState) -> str:
        used = sum(p.nbytes for p in s.memory)
        mem = f"{fmt_bytes(s.measured_bytes)} held" if s.measured_bytes is not None else f"{fmt_bytes(used)} planned"
        files = f" (+{fmt_bytes(s.file_bytes)} of mapped code)" if s.file_bytes else ""
        actors = "; ".join(
            f"{a.role} {a.state}{' ' + a.op if a.op else ''} cpu {fmt_opt(a.cpu_pct, '.0f')}%"
            f" uss {fmt_bytes(a.uss) if a.uss is not None else '-'}"
            for a in s.actors
        )
        return (
            f"cadence {s.elapsed_s:7.1f}s tokens {s.tokens} {s.tokens_per_s:.1f} tok/s"
            f" accepted {fmt_opt(s.mean_accepted, '.2f')} alpha {fmt_opt(s.alpha[-1] if s.alpha else None, '.3f')}"
            f" disk {s.disk_gbps:.2f} GB/s{s.experts_text}"
            f" mem {mem} of {fmt_bytes(s.budget_bytes)}{files} | {actors}" + "".join(f" | {n}" for n in s.notes)
        )


class NullMonitor:
    """--no-monitor."""

    shows_text = False

    def __init__(self, source=None):
        self.feed = source_of(source)[1]

    def start(self) -> None:
        pass

    def update(self, state: MonitorState | None = None) -> None:
        pass

    def stop(self) -> None:
        if self.feed is not None:
            self.feed.close()
