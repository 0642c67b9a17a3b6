"""One Chrome trace per run: `traces/<run-id>.json` in Trace Event Format.

Actors ship span batches (ts/dur in ns on CLOCK_MONOTONIC); the scheduler adds its own spans,
counters (memory used vs budget, queue depths, tokens, alpha) and flows, and `link`s the spans
that served two requests (a draft tree -> its verification). `write` turns ns into microseconds
since the run's t0, names every process and thread (`M`), keeps only flows whose start and end
both arrived, and writes one file that opens as it is in Perfetto and chrome://tracing.
`validate_trace` is the check tests (and `launch trace summary`) run on such a file.

Under a memory budget the scheduler's memory must not grow with the run: with
`TraceConfig.spill_events`, every that many events are sorted and appended to a spill file beside
the trace, and only what the final write needs stays in memory: the flows still waiting for an end
(or that came out wrong), the spans of the last few runs (a link names a span of the cycle it was made
in), the links resolved so far. `write` merges the sorted runs back into one file. A server's trace
thus holds a few runs' worth whatever the number of requests it served.
"""

from __future__ import annotations

import heapq
import itertools
import json
import math
import os
import re
from collections import defaultdict
from pathlib import Path

from scheduler.runtime_config import TraceConfig

# what a run killed outright leaves in its trace folder: its spill file (.<run id>.spill) and a trace it was writing
# (<run id>.json.tmp), the run id's pid first
LEFT_BEHIND = re.compile(r"\.?(\d+)x[0-9a-f]+\.(?:spill|json\.tmp)\Z")

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


def _order(ev: dict) -> tuple:
    return (ev["ts"], -ev.get("dur", 0))


KEEP_RUNS = 4  # a spilled span stays known this many runs for a link to name it (a link names its own cycle's)


class Flows:
    """Which flows have exactly one start and one end, in order, kept as what is not so: the flows still
    waiting for an end, and those that came out wrong. A flow that pairs up is forgotten (a third end would
    open it again, and it would never pair): the memory holds what is in flight, not what the run did."""

    def __init__(self):
        self.open: dict[tuple, list] = {}  # (cat, id) -> [starts, ends, start ts, end ts]
        self.bad: set[tuple] = set()

    def note(self, ev: dict) -> None:
        key = (ev.get("cat"), ev["id"])
        f = self.open.setdefault(key, [0, 0, None, None])
        k = 0 if ev["ph"] == "s" else 1
        f[k] += 1
        f[2 + k] = ev["ts"]
        if f[0] and f[1]:
            del self.open[key]
            if not (f[0] == 1 and f[1] == 1 and f[2] <= f[3]):
                self.bad.add(key)

    def paired(self, ev: dict) -> bool:
        key = (ev.get("cat"), ev["id"])
        return key not in self.open and key not in self.bad

    def copy(self) -> "Flows":
        out = Flows()
        out.open, out.bad = {k: list(v) for k, v in self.open.items()}, set(self.bad)
        return out


class TraceSink:
    def __init__(self, run_id: str, config: TraceConfig, t0_ns: int):
        self.run_id = run_id
        self.config = config
        self.t0_ns = t0_ns
        self._events: list[dict] = []  # ns timestamps, pid filled in; metadata aside:
        self._meta_events: dict[tuple, dict] = {}  # (pid, tid, name) -> its latest metadata event (thread names)
        self._procs: dict[int, tuple[str, int]] = {}  # pid -> (name, sort index)
        self.dropped = 0
        self.rejected = 0
        self.count = 0  # events kept, in memory and spilled
        self._links: list[tuple] = []  # links not resolved yet: (id, from (pid, req), to (pid, req), name, cat)
        self._link_count = 0
        self._linked: list[dict] = []  # the flow events of the links resolved at a spill
        # what the final write needs of the spilled events
        self._served: dict[tuple[int, int], tuple] = {}  # (pid, req) -> (ts, dur, tid, run) of its span
        self._flows = Flows()
        self._runs: list[tuple[int, int]] = []  # (offset, count) of each sorted run in the spill file
        self._spill_path: Path | None = None

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
            elif self.count >= self.config.max_events and ev["ph"] != "M":
                self.dropped += 1
            elif ev["ph"] == "M":
                ev["pid"] = pid
                self._meta_events[(pid, ev.get("tid"), ev["name"])] = ev
            else:
                ev["pid"] = pid
                self._events.append(ev)
                self.count += 1
        if self.config.spill_events and len(self._events) >= self.config.spill_events:
            self._spill()

    def counter(self, pid: int, name: str, values: dict, ts_ns: int) -> None:
        self.add(pid, [{"ph": "C", "name": name, "ts": ts_ns, "tid": 0, "args": dict(values)}])

    def link(self, src: tuple[int, int], dst: tuple[int, int], name: str, cat: str) -> None:
        """A flow from the span that served request `src` = (actor pid, req id) to the one that
        served `dst`; resolved at write time from the spans' args.req (`Actor.handle` sets it).
        A link whose spans never arrived (an actor died) is left out."""
        if self.config.enabled:
            self._link_count += 1
            self._links.append((self._link_count, src, dst, name, cat))

    @staticmethod
    def _note(ev: dict, served: dict, flows: "Flows", run: int = 0) -> None:
        """Remember what the final write needs of an event: the span that served a request, flow ends."""
        if ev["ph"] == "X" and "req" in ev.get("args", ()) and "to" not in ev["args"]:  # not the scheduler's "send"
            served[(ev["pid"], ev["args"]["req"])] = (ev["ts"], ev["dur"], ev["tid"], run)
        elif ev["ph"] in "sf":
            flows.note(ev)

    def _spill(self) -> None:
        """Move the events in memory to the spill file as one sorted run; resolve the links both of whose spans
        are known, and forget the spans of runs long gone that no waiting link names."""
        run = sorted(self._events, key=_order)
        self._events = []
        if not run:
            return
        if self._spill_path is None:
            d = self.config.path
            d.mkdir(parents=True, exist_ok=True)
            self._spill_path = d / f".{self.run_id}.spill"
        n = len(self._runs)
        with open(self._spill_path, "a") as f:
            offset = f.tell()
            for ev in run:
                self._note(ev, self._served, self._flows, n)
                f.write(json.dumps(ev, separators=(",", ":")) + "\n")
        self._runs.append((offset, len(run)))
        done, self._links = self._resolve(self._links, self._served)
        self._linked += done
        named = {end for link in self._links for end in link[1:3]}
        self._served = {k: v for k, v in self._served.items() if v[3] > n - KEEP_RUNS or k in named}

    @staticmethod
    def _resolve(links: list, served: dict) -> tuple[list[dict], list]:
        """(the flow events of the links whose spans are both known, the links still waiting for a span)."""
        out, waiting = [], []
        for i, src, dst, name, cat in links:
            a, b = served.get(src), served.get(dst)
            if a is None or b is None:
                waiting.append((i, src, dst, name, cat))
            elif a[0] + a[1] // 2 <= b[0] + b[1] // 2:  # a link back in time is left out
                out.append(
                    {"ph": "s", "name": name, "cat": cat, "id": i, "ts": a[0] + a[1] // 2, "pid": src[0], "tid": a[2]}
                )
                out.append(
                    {
                        "ph": "f",
                        "bp": "e",
                        "name": name,
                        "cat": cat,
                        "id": i,
                        "ts": b[0] + b[1] // 2,
                        "pid": dst[0],
                        "tid": b[2],
                    }
                )
        return out, waiting

    def _read_run(self, offset: int, count: int):
        with open(self._spill_path) as f:
            f.seek(offset)
            for _ in range(count):
                yield json.loads(f.readline())

    def _timed(self):
        """Every event but metadata, in time order, as written (us since t0, flows only with both ends):
        the spilled runs and what is still in memory, merged."""
        served, flows = dict(self._served), self._flows.copy()
        for ev in self._events:
            self._note(ev, served, flows)
        links = self._linked + self._resolve(self._links, served)[0]
        for ev in links:
            flows.note(ev)
        tail = sorted(self._events, key=_order)
        runs = [self._read_run(o, n) for o, n in self._runs]
        self.unpaired = 0
        links.sort(key=lambda e: (*_order(e), e["id"], e["ph"]))  # the same order, spilled or not
        for ev in heapq.merge(*runs, tail, links, key=_order):
            # a request whose actor died before handling it has a start and no end: leave it out
            if ev["ph"] in "sf" and not flows.paired(ev):
                self.unpaired += 1
                continue
            e = dict(ev)
            e["ts"] = (ev["ts"] - self.t0_ns) / 1000
            if "dur" in ev:
                e["dur"] = ev["dur"] / 1000
            yield e

    def _meta(self) -> list[dict]:
        out: list[dict] = []
        for pid, (name, sort) in self._procs.items():
            out.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}})
            out.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": sort}})
        return out + [dict(e) for e in self._meta_events.values()]

    def _other(self) -> dict:
        return {
            "run_id": self.run_id,
            "clock": "CLOCK_MONOTONIC",
            "t0_ns": self.t0_ns,
            "dropped_events": self.dropped,
            "rejected_events": self.rejected,
            "unpaired_flow_events": self.unpaired,
        }

    def to_json(self) -> dict:
        """The whole trace as one object (small traces: tests; `write` streams it instead)."""
        events = self._meta() + list(self._timed())
        return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": self._other()}

    def write(self) -> Path | None:
        if not self.config.enabled:
            return None
        d = self.config.path
        d.mkdir(parents=True, exist_ok=True)
        path = d / f"{self.run_id}.json"
        tmp = path.with_suffix(".json.tmp")
        try:
            with open(tmp, "w") as f:
                f.write('{"traceEvents":[')
                first = True
                for ev in itertools.chain(self._meta(), self._timed()):  # streamed: never the whole run at once
                    f.write(("" if first else ",") + json.dumps(ev, allow_nan=False, separators=(",", ":")))
                    first = False
                f.write('],"displayTimeUnit":"ms","otherData":' + json.dumps(self._other()) + "}")
            os.replace(tmp, path)
        finally:
            if self._spill_path is not None:
                self._spill_path.unlink(missing_ok=True)
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
    problems += [
        f"thread {t} of process {p} has slices but no thread_name" for p, t in sorted(used_threads - named_threads)
    ]
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
                problems.append(
                    f"flow {cat}/{fid} {e['ph']} at {e['ts']} on pid {e['pid']} tid {e['tid']} is inside no slice"
                )
    return problems
