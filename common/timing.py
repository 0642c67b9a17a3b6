"""Timing a call: what the benchmarks and the cost calibration measure with."""

from __future__ import annotations

import statistics
import time


def median_time(fn, reps: int = 3) -> float:
    """Seconds per call of `fn`: the median of `reps` calls after one warm-up call."""
    fn()
    return statistics.median([timed(fn) for _ in range(reps)])


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def best_time(fn, reps: int = 5) -> float:
    """Seconds per call of `fn`: the fastest of `reps` calls after one warm-up call (on a shared machine the
    fastest is the one least disturbed by other work)."""
    fn()
    return min(timed(fn) for _ in range(reps))
