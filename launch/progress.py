"""Progress bars for the long steps a user waits for (pull and convert have theirs in models/;
profiling and anything new use these): the same columns, one way to make them.

    with step_progress("profile verification widths", total=len(widths)) as advance:
        for w in widths:
            measure(w)
            advance(description=f"profile width {w}")

Not on a terminal (CI, a pipe) a bar would only print its last frame, so there each step is
logged as one plain line instead, every `log_every_s` seconds at most.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


def step_bar(console: Console | None = None) -> Progress:
    return Progress(TextColumn("{task.description:<40}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TimeRemainingColumn(), console=console, transient=False)


@contextmanager
def step_progress(description: str, total: int | None, console: Console | None = None, log_every_s: float = 5.0):
    """Yields `advance(n=1, description=None)`; a bar on a terminal, plain lines on stderr otherwise."""
    console = console or Console(stderr=True)
    if console.is_terminal:
        with step_bar(console) as bar:
            task = bar.add_task(description, total=total)

            def advance(n: int = 1, description: str | None = None) -> None:
                bar.update(task, advance=n, **({"description": description} if description else {}))
            yield advance
        return
    done, t0, last = 0, time.monotonic(), float("-inf")
    of = f"/{total}" if total else ""

    def advance(n: int = 1, description: str | None = None) -> None:
        nonlocal done, last
        done += n
        now = time.monotonic()
        if now - last >= log_every_s or (total and done >= total):
            last = now
            print(f"{description or first}: {done}{of} ({now - t0:.1f} s)", file=console.file, flush=True)
    first = description
    yield advance


def track_steps(items: Iterable, description: str, total: int | None = None, console: Console | None = None) -> Iterator:
    """`for x in track_steps(xs, "profile"): ...` with a bar (or log lines)."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)
    with step_progress(description, total, console) as advance:
        for x in items:
            yield x
            advance()

