"""Spans on the shared monotonic clock, recorded per process and shipped in batches.

`CLOCK_MONOTONIC` is one clock for every process on the machine, so spans from different
actors line up with no translation; the trace sink subtracts the run's t0 and converts ns to
microseconds. A span is recorded when it ends, as one complete (`X`) event; `with` blocks on one
thread nest, so `X` events nest per thread by construction.
"""

from __future__ import annotations

import threading
import time


class _Span:
    __slots__ = ("tracer", "name", "cat", "args", "flow_in", "flow_out", "t0")

    def __init__(self, tracer, name, cat, args, flow_in, flow_out):
        self.tracer, self.name, self.cat, self.args = tracer, name, cat, args
        self.flow_in, self.flow_out = flow_in, flow_out

    def __enter__(self):
        self.t0 = time.monotonic_ns()
        return self

    def __exit__(self, et, ev, tb):
        t1 = time.monotonic_ns()
        tr = self.tracer
        tid = threading.get_native_id()
        if tid not in tr._threads:
            tr._threads[tid] = threading.current_thread().name
            tr.events.append({"ph": "M", "name": "thread_name", "tid": tid, "args": {"name": tr._threads[tid]}})
        dur = max(t1 - self.t0, 1000)  # >= 1 us, so a flow can bind inside it
        ev_ = {"ph": "X", "name": self.name, "cat": self.cat, "ts": self.t0, "dur": dur, "tid": tid}
        if self.args:
            ev_["args"] = self.args
        if et is not None:
            ev_.setdefault("args", {})["error"] = et.__name__
        tr.events.append(ev_)
        # Flows bind to the slice that encloses them. A request leaves after its span began and is
        # handled after it arrived, so start at the sender's start, end at the receiver's middle:
        # at the sender's middle, a sender preempted after sending could start after the end.
        mid = self.t0 + dur // 2
        if self.flow_in is not None:
            tr.events.append(
                {"ph": "f", "bp": "e", "name": "request", "cat": "flow", "id": self.flow_in, "ts": mid, "tid": tid}
            )
        if self.flow_out is not None:
            tr.events.append(
                {"ph": "s", "name": "request", "cat": "flow", "id": self.flow_out, "ts": self.t0, "tid": tid}
            )
        return False


class _NoSpan:
    def __enter__(self):
        return self

    def __exit__(self, et, ev, tb):
        return False


_NOOP = _NoSpan()  # what a disabled tracer hands out: no clock reads, no allocation


class Tracer:
    """Collects events until `drain()`; cheap enough to leave on (a span costs a few us)."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.events: list[dict] = []
        self._threads: dict[int, str] = {}

    def span(
        self,
        name: str,
        cat: str = "",
        args: dict | None = None,
        flow_in: int | None = None,
        flow_out: int | None = None,
    ) -> _Span:
        """`with tracer.span("layer", cat="verifier", args={...}, flow_in=req.flow_id): ...`"""
        if not self.enabled:
            return _NOOP
        return _Span(self, name, cat, args, flow_in, flow_out)

    def counter(self, name: str, values: dict[str, float]) -> None:
        if self.enabled:
            self.events.append(
                {
                    "ph": "C",
                    "name": name,
                    "ts": time.monotonic_ns(),
                    "args": dict(values),
                    "tid": threading.get_native_id(),
                }
            )

    def instant(self, name: str, cat: str = "", args: dict | None = None) -> None:
        if self.enabled:
            ev = {
                "ph": "i",
                "s": "p",
                "name": name,
                "cat": cat,
                "ts": time.monotonic_ns(),
                "tid": threading.get_native_id(),
            }
            if args:
                ev["args"] = args
            self.events.append(ev)

    def drain(self) -> list[dict]:
        out, self.events = self.events, []
        return out
