"""One Chrome trace per run: `traces/<run-id>.json` in Trace Event Format.

Actors ship span batches (ts/dur in ns on CLOCK_MONOTONIC); the scheduler adds its own spans,
counters (memory used vs budget, queue depths, tokens, alpha) and flows, and `link`s the spans
that served two requests (a draft tree -> its verification). `write` turns ns into microseconds
since the run's t0, names every process and thread (`M`), keeps only flows whose start and end
both arrived, and writes one file that opens as it is in Perfetto and chrome://tracing.
`validate_trace` is the check tests (and `launch trace summary`) run on such a file.
"""
from __future__ import annotations

import json
import math
import os
from collections import defaultdict
from pathlib import Path

from scheduler.config import TraceConfig

_PHASES = {"X", "M", "C", "s", "f", "i"}
_FIELDS = {"ph", "name", "cat", "ts", "dur", "tid", "args", "id", "bp", "s"}


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _sane(ev) -> bool:
    """An event from an actor has only the fields and types we write."""
    if not isinstance(ev, dict) or ev.get("ph") not in _PHASES or not set(ev) <= _FIELDS:
        return False
    if not isinstance(ev.get("name"), str) or type(ev.get("tid", 0)) is not int:
        return False
    if ev["ph"] != "M" and type(ev.get("ts")) is not int:
        return False
    if ev["ph"] == "X" and (type(ev.get("dur")) is not int or ev["dur"] < 0):
        return False
    if ev["ph"] in "sf" and type(ev.get("id")) is not int:
        return False
    if ev["ph"] == "C" and not (isinstance(ev.get("args"), dict) and all(_finite(v) for v in ev["args"].values())):
        return False
    return "args" not in ev or isinstance(ev["args"], dict)


class TraceSink:
    def __init__(self, run_id: str, config: TraceConfig, t0_ns: int):
        self.run_id = run_id
        self.config = config
        self.t0_ns = t0_ns
        self._events: list[dict] = []  # ns timestamps, pid filled in
        self._procs: dict[int, tuple[str, int]] = {}  # pid -> (name, sort index)
        self.dropped = 0
        self.rejected = 0
        self._links: list[tuple] = []  # (from (pid, req), to (pid, req), name, cat)

    def name_process(self, pid: int, name: str) -> None:
        """Name (or rename) a process; the first naming fixes its place in the list."""
        sort = self._procs[pid][1] if pid in self._procs else len(self._procs)
        self._procs[pid] = (name, sort)

    def add(self, pid: int, events: list) -> None:
        if not self.config.enabled:
            return
        for ev in events:
            if not _sane(ev):
                self.rejected += 1
            elif len(self._events) >= self.config.max_events and ev["ph"] != "M":
                self.dropped += 1
            else:
                ev["pid"] = pid
                self._events.append(ev)

    def counter(self, pid: int, name: str, values: dict, ts_ns: int) -> None:
        self.add(pid, [{"ph": "C", "name": name, "ts": ts_ns, "tid": 0, "args": dict(values)}])

    def link(self, src: tuple[int, int], dst: tuple[int, int], name: str, cat: str) -> None:
        """A flow from the span that served request `src` = (actor pid, req id) to the one that
        served `dst`; resolved at write time from the spans' args.req (`Actor.handle` sets it).
        A link whose spans never arrived (an actor died) is left out."""
        if self.config.enabled:
            self._links.append((src, dst, name, cat))

    def _link_events(self) -> list[dict]:
        if not self._links:
            return []
        served = {}
        for ev in self._events:
            if ev["ph"] == "X" and "req" in ev.get("args", ()) and "to" not in ev["args"]:  # not the scheduler's "send"
                served[(ev["pid"], ev["args"]["req"])] = ev
        out = []
        for i, (src, dst, name, cat) in enumerate(self._links, 1):
            a, b = served.get(src), served.get(dst)
            if a is None or b is None or a["ts"] + a["dur"] // 2 > b["ts"] + b["dur"] // 2:
                continue
            out.append({"ph": "s", "name": name, "cat": cat, "id": i, "ts": a["ts"] + a["dur"] // 2,
                        "pid": a["pid"], "tid": a["tid"]})
            out.append({"ph": "f", "bp": "e", "name": name, "cat": cat, "id": i, "ts": b["ts"] + b["dur"] // 2,
                        "pid": b["pid"], "tid": b["tid"]})
        return out

    def to_json(self) -> dict:
        out: list[dict] = []
        for pid, (name, sort) in self._procs.items():
            out.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}})
            out.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": sort}})
        flows: dict[tuple, list[dict]] = defaultdict(list)  # (cat, id) -> its events, as the validator pairs them
        timed = []
        for ev in self._events + self._link_events():
            if ev["ph"] == "M":
                out.append(dict(ev))
                continue
            e = dict(ev)
            e["ts"] = (ev["ts"] - self.t0_ns) / 1000
            if "dur" in ev:
                e["dur"] = ev["dur"] / 1000
            if e["ph"] in "sf":
                flows[(e.get("cat"), e["id"])].append(e)
            else:
                timed.append(e)
        unpaired = 0
        for pair in flows.values():
            starts = [e for e in pair if e["ph"] == "s"]
            ends = [e for e in pair if e["ph"] == "f"]
            # a request whose actor died before handling it has a start and no end: leave it out
            if len(starts) == 1 and len(ends) == 1 and starts[0]["ts"] <= ends[0]["ts"]:
                timed.extend(pair)
            else:
                unpaired += len(pair)
        timed.sort(key=lambda e: (e["ts"], -e.get("dur", 0)))
        return {
            "traceEvents": out + timed,
            "displayTimeUnit": "ms",
            "otherData": {"run_id": self.run_id, "clock": "CLOCK_MONOTONIC", "t0_ns": self.t0_ns,
                          "dropped_events": self.dropped, "rejected_events": self.rejected,
                          "unpaired_flow_events": unpaired},
        }

    def write(self) -> Path | None:
        if not self.config.enabled:
            return None
        d = self.config.path
        d.mkdir(parents=True, exist_ok=True)
        path = d / f"{self.run_id}.json"
        tmp = path.with_suffix(".json.tmp")
        with open(tmp, "w") as f:
            json.dump(self.to_json(), f, allow_nan=False, separators=(",", ":"))
        os.replace(tmp, path)
        return path


# -- validation ------------------------------------------------------------------------------

def _ns(us) -> int:
    return round(us * 1000)


def validate_trace(obj) -> list[str]:
    """Problems that would make Perfetto or chrome://tracing drop or misdraw events; [] if none."""
    events = obj.get("traceEvents") if isinstance(obj, dict) else obj
    if not isinstance(events, list):
        return ["the trace is neither a list of events nor an object with a traceEvents list"]
    problems: list[str] = []
    named_procs, named_threads = set(), set()
    slices: dict[tuple, list[tuple[int, int, str]]] = defaultdict(list)
    flows: dict[tuple, list[dict]] = defaultdict(list)
    used_procs, used_threads = set(), set()
    for i, ev in enumerate(events):
        where = f"event {i}"
        if not isinstance(ev, dict):
            problems.append(f"{where} is not an object")
            continue
        ph = ev.get("ph")
        if ph not in _PHASES:
            problems.append(f"{where} has unknown phase {ph!r}")
            continue
        if not isinstance(ev.get("name"), str) or type(ev.get("pid")) is not int:
            problems.append(f"{where} ({ph}) lacks a string name or an int pid")
            continue
        pid, tid = ev["pid"], ev.get("tid")
        if ph == "M":
            if ev["name"] in ("process_name", "thread_name") and not isinstance(ev.get("args", {}).get("name"), str):
                problems.append(f"{where} ({ev['name']}) lacks args.name")
            elif ev["name"] == "process_name":
                named_procs.add(pid)
            elif ev["name"] == "thread_name":
                named_threads.add((pid, tid))
            continue
        if not _finite(ev.get("ts")):
            problems.append(f"{where} ({ph} {ev['name']!r}) lacks a finite ts")
            continue
        used_procs.add(pid)
        if ph == "X":
            if not _finite(ev.get("dur")) or ev["dur"] < 0:
                problems.append(f"{where} (X {ev['name']!r}) lacks a dur >= 0")
                continue
            if type(tid) is not int:
                problems.append(f"{where} (X {ev['name']!r}) lacks an int tid")
                continue
            used_threads.add((pid, tid))
            slices[(pid, tid)].append((_ns(ev["ts"]), _ns(ev["ts"]) + _ns(ev["dur"]), ev["name"]))
        elif ph == "C":
            args = ev.get("args")
            if not isinstance(args, dict) or not args or not all(_finite(v) for v in args.values()):
                problems.append(f"{where} (C {ev['name']!r}) needs numeric args")
        elif ph in "sf":
            if "id" not in ev or type(tid) is not int:
                problems.append(f"{where} ({ph} {ev['name']!r}) lacks an id or an int tid")
                continue
            flows[(ev.get("cat"), ev["id"])].append(ev)
    problems += _check_nesting(slices)
    problems += _check_flows(flows, slices)
    problems += [f"process {p} has events but no process_name" for p in sorted(used_procs - named_procs)]
    problems += [f"thread {t} of process {p} has slices but no thread_name" for p, t in sorted(used_threads - named_threads)]
    return problems


def _check_nesting(slices: dict) -> list[str]:
    problems = []
    for (pid, tid), spans in slices.items():
        stack: list[tuple[int, int, str]] = []
        for start, end, name in sorted(spans, key=lambda s: (s[0], -s[1])):
            while stack and stack[-1][1] <= start:
                stack.pop()
            if stack and end > stack[-1][1]:
                problems.append(f"X {name!r} on pid {pid} tid {tid} starts inside {stack[-1][2]!r} but ends after it")
                continue
            stack.append((start, end, name))
    return problems


def _encloses(slices: dict, ev: dict) -> bool:
    ts = _ns(ev["ts"])
    return any(s <= ts <= e for s, e, _ in slices.get((ev["pid"], ev["tid"]), ()))


def _check_flows(flows: dict, slices: dict) -> list[str]:
    problems = []
    for (cat, fid), evs in flows.items():
        starts = [e for e in evs if e["ph"] == "s"]
        ends = [e for e in evs if e["ph"] == "f"]
        if len(starts) != 1 or len(ends) != 1:
            problems.append(f"flow {cat}/{fid} has {len(starts)} start(s) and {len(ends)} end(s); it needs one of each")
            continue
        s, f = starts[0], ends[0]
        if f["ts"] < s["ts"]:
            problems.append(f"flow {cat}/{fid} ends before it starts")
        for e in (s, f):
            if not _encloses(slices, e):
                problems.append(f"flow {cat}/{fid} {e['ph']} at {e['ts']} on pid {e['pid']} tid {e['tid']} is inside no slice")
    return problems
