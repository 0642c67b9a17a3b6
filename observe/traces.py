"""Chrome traces on disk: reading one (and saying why a file is not one), the categories of its spans,
and where `launch run --trace PATH` puts it. What the trace says is observe/summary.py's."""

from __future__ import annotations

import json
from pathlib import Path

# what `cat` says -> our category
CATEGORIES = {
    "draft": "draft",
    "verify": "verify",
    "verifier": "verify",
    "attention": "attention",
    "sparse": "attention",
    "load": "load",
    "loader": "load",
    "io": "load",
    "wait": "wait",
    "idle": "wait",
    "scheduler": "scheduler",
    "setup": "setup",
}
COMPUTE = ("draft", "verify", "attention")
SPLIT = ("verify", "draft", "load", "other", "idle")  # priority order of the per-token split


def load_trace(path) -> dict:
    """A trace file as a dict with `traceEvents` (a bare event list is wrapped)."""
    obj = json.loads(Path(path).read_text())
    return {"traceEvents": obj} if isinstance(obj, list) else obj


def not_a_trace(trace) -> str | None:
    """Why a loaded JSON file is not a Chrome trace (None when it is one): every trace event has a phase
    (`ph`), and `launch run --json` rows, which users mistake for traces, have `new_token_ids` instead."""
    evs = trace.get("traceEvents") if isinstance(trace, dict) else None
    if not isinstance(evs, list):
        return "it has no traceEvents list"
    if evs and all(isinstance(e, dict) and "new_token_ids" in e for e in evs):
        return "it holds the result rows `launch run --json` writes"
    if not any(isinstance(e, dict) and "ph" in e for e in evs):
        return "none of its entries is a trace event (an object with a `ph` field)" if evs else "it holds no events"
    return None


def events_of(trace) -> list[dict]:
    evs = trace.get("traceEvents") if isinstance(trace, dict) else trace
    return [e for e in evs or [] if isinstance(e, dict)]


def category(ev: dict) -> str:
    name, cat = ev.get("name") or "", ev.get("cat") or ""
    if name.startswith("wait:") or name in ("wait", "idle") or (cat == "scheduler" and name.startswith("call ")):
        return "wait"  # `Runtime.call` spans enclose the wait for a reply
    return CATEGORIES.get(cat, "other")


def wait_what(ev: dict) -> str:
    name = ev.get("name") or ""
    return (name[5:] or "?") if name.startswith("wait:") else name


# -- `launch run --trace PATH` -------------------------------------------------------------------


def trace_dir(wanted: str | None) -> str | None:
    """The directory for `TraceConfig(dir=...)`: PATH itself, or a .json PATH's folder (None: the default)."""
    if wanted is None:
        return None
    p = Path(wanted)
    return str(p.parent) if p.suffix == ".json" else str(p)


def place_trace(written: Path | None, wanted: str | None) -> Path | None:
    """After the run: a .json PATH receives the trace the scheduler wrote as <run-id>.json."""
    if written is None or wanted is None or Path(wanted).suffix != ".json":
        return written
    target = Path(wanted)
    if Path(written).resolve() != target.resolve():
        target.parent.mkdir(parents=True, exist_ok=True)
        Path(written).replace(target)
    return target
