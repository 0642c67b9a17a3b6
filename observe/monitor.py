"""`launch run --monitor`: a live view of the run, built from what the runtime reports. A `MonitorFeed`
(observe/feed.py; `MonitorFeed(None)` in-process) takes the run's events and callbacks;
`open_monitor(feed, args.monitor)` gives a Monitor (a terminal), LogMonitor or NullMonitor, started
and stopped around the run (launch/cmd_run.py).

Everything drawn comes from one frozen `MonitorState` (a snapshot): `Monitor.render(state)` gives a
Rich renderable, `LogMonitor.line(state)` one plain line. `Monitor` draws with `rich.live.Live`,
whose thread pulls a snapshot 4 times a second; the run's thread pays only for the feed's callbacks.
"""

from __future__ import annotations

import sys

from rich.console import Console
from rich.control import strip_control_codes
from rich.live import Live
from rich.segment import Segment
from rich.style import Style

from observe.lines import LogMonitor, NullMonitor
from observe.state import MonitorState, fmt_opt, snapshot_of, source_of
from scheduler.ledger import fmt_bytes

SPARK = "▁▂▃▄▅▆▇█"


# -- drawing ----------------------------------------------------------------------------------------

PART_STYLES = (
    ("draft", "cyan"),
    ("target", "magenta"),
    ("resident", "magenta"),
    ("stream", "yellow"),
    ("slot", "yellow"),
    ("kv", "green"),
    ("arena", "blue"),
    ("pss", "red"),
)


def part_style(name: str) -> str:
    low = name.lower()
    return next((style for key, style in PART_STYLES if key in low), "white")


def sparkline(values, width: int = 40) -> str:
    vals = list(values)[-width:]
    if not vals:
        return ""
    lo, hi = min(vals), max(vals)
    scale = (len(SPARK) - 1) / (hi - lo) if hi > lo else 0
    return "".join(SPARK[round((v - lo) * scale)] if scale else SPARK[len(SPARK) // 2] for v in vals)


Run = tuple  # (text, style): one styled stretch of a line


class Frame:
    """A frame as lines of (text, style) runs, handed to Rich as ready segments: no markup, no
    wrapping, no measuring: several times cheaper than the same lines as Rich Text, let alone panels and
    tables (BENCHMARKS.md, "Monitor overhead")."""

    def __init__(self):
        self.lines: list[list[Run]] = []

    def add(self, *runs) -> None:
        """Append a line; each run is a str or a (str, style) pair."""
        self.lines.append([r if isinstance(r, tuple) else (r, "") for r in runs])

    def __rich_console__(self, console, options):
        for runs in self.lines:
            for text, style in runs:
                yield Segment(text, Style.parse(style) if style else None)  # Style.parse is cached
            yield _NEWLINE

    @property
    def plain(self) -> str:
        return "\n".join("".join(t for t, _ in runs) for runs in self.lines)


_NEWLINE = Segment.line()


def _bar(parts, budget: int, width: int) -> list[Run]:
    """`budget` as `width` cells: each (name, bytes) part a run of its colour, the rest free."""
    runs, used, cells_used = [], 0, 0
    budget = max(budget, sum(n for _, n in parts), 1)
    for name, n in parts:
        cells = round(width * (used + n) / budget) - round(width * used / budget)
        used += n
        cells_used += cells
        runs.append(("█" * cells, part_style(name)))
    runs.append(("░" * max(width - cells_used, 0), "dim"))
    return runs


def memory_bar(state: MonitorState, width: int = 60) -> list[Run]:
    """The memory plan's parts against the budget."""
    return _bar([(p.name, p.nbytes) for p in state.memory], state.budget_bytes, width)


def text_tail(text: str, width: int, lines: int) -> list[str]:
    """The last `lines` screen lines of `text` wrapped at `width` columns (so a frame keeps its height),
    tabs expanded and control characters dropped."""
    out: list[str] = []
    for line in reversed(strip_control_codes(text.expandtabs(4)).splitlines()):
        chunks = [line[i : i + width] for i in range(0, len(line), width)] or [""]
        out[:0] = chunks
        if len(out) >= lines:
            break
    return out[-lines:]


class Monitor:
    """The Rich dashboard. `source`: a MonitorFeed (its `snapshot` pulled at every refresh; closed
    at `stop`), a callable returning a MonitorState, or None (shows what `update(state)` gave last)."""

    shows_text = True  # the dashboard shows the generated text: the caller need not print it

    def __init__(self, source=None, console: Console | None = None, refresh_hz: float = 4.0, text_lines: int = 6):
        self.source, self.feed = source_of(source)
        self.console = console or Console()
        self.refresh_hz = refresh_hz
        self.text_lines = text_lines
        self.frames = 0  # renders so far (the overhead benchmark reads it)
        self._state = MonitorState()
        self._live: Live | None = None

    def __enter__(self) -> "Monitor":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        self._live = Live(
            console=self.console, refresh_per_second=self.refresh_hz, get_renderable=self.frame, transient=False
        )
        self._live.start()

    def update(self, state: MonitorState | None = None) -> None:
        """Show `state` from the next refresh on (a cheap store), or with none, pull the source now."""
        self._state = state if state is not None else snapshot_of(self.source, self._state)

    def stop(self) -> None:
        if self._live is not None:
            self._live.stop()  # draws the last frame
            self._live = None
        if self.feed is not None:
            self.feed.close()

    def threads(self) -> list:
        """The threads this monitor runs (Rich's refresh thread: private API, best effort)."""
        t = getattr(self._live, "_refresh_thread", None) if self._live is not None else None
        return [t] if t is not None else []

    def frame(self):
        self._state = snapshot_of(self.source, self._state)
        return self.render(self._state)

    def render(self, state: MonitorState | None = None) -> Frame:
        """One frame, a `Frame` of plain lines: the run shares the CPU with this, so it stays cheap."""
        s = state if state is not None else self._state
        self.frames += 1
        width = self.console.width
        f = Frame()
        f.add(*_rule(f"cadence {s.title}  {s.elapsed_s:.1f} s", width, "blue"))
        f.add(
            (f"{s.tokens}", "bold"),
            " tokens  ",
            (f"{s.tokens_per_s:.1f}", "bold green"),
            " tok/s",
            f" (avg {s.avg_tokens_per_s:.1f})  mean accepted ",
            (fmt_opt(s.mean_accepted, ".2f"), "bold"),
            "  alpha ",
            (fmt_opt(s.alpha[-1] if s.alpha else None, ".3f"), "bold"),
            "  disk ",
            (f"{s.disk_gbps:.2f}", "bold yellow"),
            " GB/s",
            s.experts_text,
        )
        _actors(f, s)
        _memory(f, s, width)
        _acceptance(f, s)
        f.add(*_rule("text", width, "dim"))
        notes = list(s.notes[-3:])
        # the whole frame fits the terminal (80x24 included): the text gets the lines left over
        lines = max(2, min(self.text_lines, self.console.height - len(f.lines) - len(notes) - 1))
        tail = text_tail(s.text, width, lines)
        for line in tail + [""] * (lines - len(tail)):
            f.add(line)
        for n in notes:
            f.add((n[:width], "bold red"))
        return f


def _actors(f: Frame, s: MonitorState) -> None:
    rows = [("role", "pid", "state", "doing", "for", "CPU %", "USS")]
    rows += [
        (
            a.role,
            str(a.pid),
            a.state,
            a.op or "idle",
            f"{a.op_s * 1000:.0f} ms" if a.op_s is not None else "",
            fmt_opt(a.cpu_pct, ".0f"),
            fmt_bytes(a.uss) if a.uss is not None else "-",
        )
        for a in s.actors
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(7)]
    for n, r in enumerate(rows):
        cells = [c.rjust(w) if i in (1, 4, 5, 6) else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
        f.add((" " + "  ".join(cells), "bold" if n == 0 else ("dim" if r[3] == "idle" else "")))


def _memory(f: Frame, s: MonitorState, width: int) -> None:
    used = sum(p.nbytes for p in s.memory)
    bar = max(10, min(40, width - 40))
    of = "budget" if s.planned else "RAM"
    if s.planned:
        f.add("memory ", *memory_bar(s, bar), f" {_short(used)} planned of {_short(s.budget_bytes)}")
    if s.measured_bytes is not None:
        f.add(
            "live   ",
            *_bar([("PSS", s.measured_bytes)], s.budget_bytes, bar),
            f" {_short(s.measured_bytes)} held of {_short(s.budget_bytes)} {of}"
            + (f" (+{_short(s.file_bytes)} code)" if s.file_bytes else ""),
        )
    if s.planned:
        legend, n = ["       "], 7
        for p in s.memory:
            item = f"{p.name} {_short(p.nbytes)}  "
            if n + 2 + len(item) > width:  # one line: the parts that fit
                break
            legend += [("■ ", part_style(p.name)), item]
            n += 2 + len(item)
        f.add(*legend)


def _acceptance(f: Frame, s: MonitorState) -> None:
    left = [[("accepted length", "bold")]]
    top = max((c for _, c in s.accepted_hist), default=0)
    for k, c in sorted(sorted(s.accepted_hist, key=lambda x: -x[1])[:5]):  # the 5 commonest lengths
        left.append([f"{k:>3} ", ("█" * max(1, round(16 * c / top)), "green"), f" {c}"])
    right = [[("alpha", "bold")], [(sparkline(s.alpha, 40), "cyan")]]
    if s.alpha:
        right.append([(f"{min(s.alpha):.3f} .. {max(s.alpha):.3f} over {len(s.alpha)} verifications", "dim")])
    for i in range(max(len(left), len(right))):
        runs = left[i] if i < len(left) else []
        pad = 28 - sum(len(t) for t, _ in (r if isinstance(r, tuple) else (r, "") for r in runs))
        f.add(*runs, " " * pad, *(right[i] if i < len(right) else []))


def _rule(title: str, width: int, style: str) -> list[Run]:
    title = f" {title.strip()} "
    left = max((width - len(title)) // 2, 3)
    return [("─" * left, style), (title, ""), ("─" * max(width - left - len(title), 3), style)]


def _short(n: float) -> str:
    for unit, size in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.1f}{unit}"
    return f"{int(n)}B"


def add_monitor_args(p, trace: bool = True) -> None:
    """--monitor / --no-monitor (and --trace PATH) for `launch run`."""
    p.add_argument(
        "--monitor",
        action="store_true",
        default=None,
        help="live dashboard (the default when stdout is a terminal; plain log lines on stderr otherwise)",
    )
    p.add_argument("--no-monitor", dest="monitor", action="store_false", help="no dashboard, no log lines")
    if trace:
        p.add_argument(
            "--trace",
            dest="trace_path",
            metavar="PATH",
            help="write the Chrome trace here (a .json file, or a directory)",
        )


def open_monitor(source, mode: bool | None, stdout=None, console: Console | None = None):
    """mode None (the default) or True: the dashboard on a terminal, else plain log lines on stderr;
    False (--no-monitor): nothing."""
    out = stdout if stdout is not None else sys.stdout
    tty = bool(getattr(out, "isatty", lambda: False)())
    if mode is False:
        return NullMonitor(source)
    if tty:
        return Monitor(source, console=console or Console(file=out))
    return LogMonitor(source)
