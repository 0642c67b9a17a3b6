"""`launch trace summary`: where a run's time went, from its Chrome trace alone.

Pure functions over a trace dict (Trace Event Format, ts/dur in microseconds), so they work on
any trace the runtime writes and are tested on hand-made traces with known answers.

Every complete (`X`) span gets a category from its `cat` (actors use their role: `draft`,
`verifier`, `sparse`, `loader`; finer spans `draft`, `verify`, `load`, `attention`) or, for
`wait:<what>` / `idle` names and the scheduler's `call <op>` (its wait for a reply), `wait`.
Unknown categories count as `other`. `setup` spans (loading weights before the first request) are
reported apart and left out of everything else. On each thread an instant belongs to its
innermost span (a `wait:layer` nested in a `verify` span is waiting, not verifying; a `send`
inside a `call` is work); a process is busy when any of its threads works, at anything but
waiting. The window is the extent of all spans but setup.

- busy % per actor (process): its work / the window;
- compute/I-O overlap: how much of the time a load ran was also spent computing (draft, verify,
  attention) somewhere, i.e. the share of I/O hidden behind compute;
- verifier waits: its `wait:<what>` spans, plus the gaps between its spans, put down to what was
  running meanwhile: a load (`layer`), drafting (`tree`), the sparse worker (`attention`), or
  nothing (`idle`);
- time per generated token: each instant of the window goes to one bucket, the first that is
  busy in the order verify (incl. attention) > draft > load > other > idle, divided by the
  tokens (the pipeline's `tokens` counter, or given).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from observe.intervals import exclusive, intersect, length, subtract, union
from observe.traces import COMPUTE, SPLIT, category, events_of, wait_what


@dataclass
class ActorSummary:
    pid: int
    name: str  # process_name, e.g. "verifier (FakeVerifierActor)"
    role: str  # its first word
    threads: int
    busy_s: float
    busy_pct: float
    by_category: dict[str, float]  # category -> seconds of work
    top_ops: list[tuple[str, int, float]]  # (span name, count, seconds summed), largest first
    setup_s: float = 0.0  # in `setup` spans (loading), outside the window


@dataclass
class TraceSummary:
    run_id: str | None
    window_s: float
    actors: list[ActorSummary]
    io_s: float  # time any load ran
    compute_s: float  # time any draft / verify / attention ran
    overlap_s: float  # both at once
    verifier_busy_s: float
    waits: dict[str, tuple[int, float]]  # from wait:<what> spans: what -> (count, seconds)
    gaps: dict[str, float]  # verifier gaps by what ran meanwhile: layer | tree | attention | idle
    tokens: int | None
    split_s: dict[str, float]  # SPLIT bucket -> seconds (sums to the window)
    categories: dict[str, float] = field(default_factory=dict)  # category -> seconds any thread did it

    @property
    def overlap_pct(self) -> float | None:
        """Share of I/O time hidden behind compute; None if nothing was loaded."""
        return 100.0 * self.overlap_s / self.io_s if self.io_s else None

    @property
    def per_token_ms(self) -> dict[str, float] | None:
        if not self.tokens:
            return None
        return {k: 1000.0 * v / self.tokens for k, v in self.split_s.items()}


def _names(evs) -> tuple[dict, dict]:
    procs, threads = {}, {}
    for e in evs:
        if e.get("ph") == "M" and isinstance(e.get("args"), dict):
            if e.get("name") == "process_name":
                procs[e.get("pid")] = str(e["args"].get("name"))
            elif e.get("name") == "thread_name":
                threads[(e.get("pid"), e.get("tid"))] = str(e["args"].get("name"))
    return procs, threads


def _tokens(evs) -> int | None:
    """The pipeline's `tokens` counter (its last total); else the sum over `accepted` counters."""
    totals = [
        e["args"].get("total")
        for e in evs
        if e.get("ph") == "C" and e.get("name") == "tokens" and isinstance(e.get("args"), dict)
    ]
    totals = [t for t in totals if isinstance(t, (int, float))]
    if totals:
        return int(max(totals))
    acc = [
        e["args"].get("length")
        for e in evs
        if e.get("ph") == "C" and e.get("name") == "accepted" and isinstance(e.get("args"), dict)
    ]
    acc = [a for a in acc if isinstance(a, (int, float))]
    return int(sum(a + 1 for a in acc)) if acc else None


def summarize(trace, tokens: int | None = None) -> TraceSummary:
    evs = events_of(trace)
    procs, _ = _names(evs)
    sp = _Spans.of(evs, procs)
    self_ = sp.self_times()
    cat_u = {c: union(v) for c, v in self_.cat_iv.items()}
    io = cat_u.get("load", [])
    compute = union([iv for c in COMPUTE for iv in cat_u.get(c, [])])
    vpids = [p for p, r in sp.roles.items() if r == "verifier"] or sorted(
        p for p, c in self_.proc_cat.items() if "verify" in c
    )
    v_work = union([iv for p in vpids for iv in self_.proc_iv.get(p, [])])
    v_wait = union([iv for k, v in self_.waits_iv.items() if k[0] in vpids for iv in v])
    return TraceSummary(
        run_id=(trace.get("otherData") or {}).get("run_id") if isinstance(trace, dict) else None,
        window_s=sp.span_s,
        actors=_actors(sp, self_, procs),
        io_s=length(io) / 1e6,
        compute_s=length(compute) / 1e6,
        overlap_s=length(intersect(io, compute)) / 1e6,
        verifier_busy_s=length(v_work) / 1e6,
        waits={k: (c, s) for k, (c, s) in sorted(self_.waits.items(), key=lambda x: -x[1][1])},
        gaps=_gaps(sp.window, v_work, v_wait, cat_u),
        tokens=tokens if tokens is not None else _tokens(evs),
        split_s=_split(sp.window, cat_u),
        categories={c: length(v) / 1e6 for c, v in sorted(cat_u.items())},
    )


@dataclass
class _Spans:
    """A trace's complete spans, per thread (setup apart), and the window they cover."""

    roles: dict  # pid -> its role (the process name's first word)
    per_thread: dict  # (pid, tid) -> [(start, end, (category, what it waits for))]
    ops: dict  # pid -> span name -> [count, microseconds]
    setup: dict  # pid -> setup intervals
    window: tuple[float, float]

    @property
    def span_s(self) -> float:
        return (self.window[1] - self.window[0]) / 1e6

    @classmethod
    def of(cls, evs: list[dict], procs: dict) -> "_Spans":
        per_thread: dict[tuple, list] = defaultdict(list)
        ops: dict = defaultdict(lambda: defaultdict(lambda: [0, 0.0]))
        setup: dict = defaultdict(list)
        for e in evs:
            if (
                e.get("ph") != "X"
                or not isinstance(e.get("ts"), (int, float))
                or not isinstance(e.get("dur"), (int, float))
            ):
                continue
            pid, iv, cat = e.get("pid"), (float(e["ts"]), float(e["ts"]) + float(e["dur"])), category(e)
            if cat == "setup":
                setup[pid].append(iv)
                continue
            op = ops[pid][e.get("name", "?")]
            op[0], op[1] = op[0] + 1, op[1] + iv[1] - iv[0]
            per_thread[(pid, e.get("tid"))].append((*iv, (cat, wait_what(e) if cat == "wait" else None)))
        window = union([iv[:2] for ivs in per_thread.values() for iv in ivs])
        roles = {pid: (name.split() or ["?"])[0] for pid, name in procs.items()}
        return cls(roles, per_thread, ops, setup, (window[0][0], window[-1][1]) if window else (0.0, 0.0))

    def counts_waits(self, pid) -> bool:
        """The verifier's wait:<what> spans are counted (anyone's, if no actor is a verifier)."""
        return self.roles.get(pid) == "verifier" or "verifier" not in self.roles.values()

    def self_times(self) -> "_SelfTimes":
        """Each thread's self time (the innermost span decides) per process and per category."""
        st = _SelfTimes()
        for pid in self.setup:
            st.threads[pid]  # a process that only loaded still gets its row
        for (pid, _), ivs in self.per_thread.items():
            if self.counts_waits(pid):
                for _, _, (cat, what) in ivs:
                    if cat == "wait":
                        st.waits[what][0] += 1
        for key, ivs in self.per_thread.items():
            pid = key[0]
            st.threads[pid].add(key[1])
            for s0, s1, (cat, what) in exclusive(ivs):
                if cat == "wait":
                    st.waits_iv[key].append((s0, s1))
                    if self.counts_waits(pid):
                        st.waits[what][1] += (s1 - s0) / 1e6
                else:
                    st.cat_iv[cat].append((s0, s1))
                    st.proc_iv[pid].append((s0, s1))
                    st.proc_cat[pid][cat].append((s0, s1))
        return st


@dataclass
class _SelfTimes:
    waits: dict = field(default_factory=lambda: defaultdict(lambda: [0, 0.0]))  # what -> [count, seconds]
    waits_iv: dict = field(default_factory=lambda: defaultdict(list))  # (pid, tid) -> wait intervals
    cat_iv: dict = field(default_factory=lambda: defaultdict(list))  # category -> intervals
    proc_iv: dict = field(default_factory=lambda: defaultdict(list))  # pid -> work intervals
    proc_cat: dict = field(default_factory=lambda: defaultdict(lambda: defaultdict(list)))  # pid -> category -> ...
    threads: dict = field(default_factory=lambda: defaultdict(set))  # pid -> its threads


def _actors(sp: _Spans, st: _SelfTimes, procs: dict) -> list[ActorSummary]:
    out = []
    for pid in sorted(st.threads, key=lambda p: (list(procs).index(p) if p in procs else len(procs), str(p))):
        busy = length(union(st.proc_iv[pid])) / 1e6
        top = sorted(((n, c, t / 1e6) for n, (c, t) in sp.ops[pid].items()), key=lambda x: -x[2])[:5]
        out.append(
            ActorSummary(
                pid,
                procs.get(pid, f"pid {pid}"),
                sp.roles.get(pid, f"pid {pid}"),
                len(st.threads[pid]),
                busy,
                100.0 * busy / sp.span_s if sp.span_s else 0.0,
                {c: length(union(v)) / 1e6 for c, v in sorted(st.proc_cat[pid].items())},
                top,
                length(union(sp.setup.get(pid, []))) / 1e6,
            )
        )
    return out


def _gaps(window, v_work, v_wait, cat_u: dict) -> dict[str, float]:
    """The verifier's gaps, put down to what ran meanwhile."""
    gaps: dict[str, float] = {}
    if v_work:
        rest = subtract([window], union(v_work + v_wait))
        for what, cat in (("layer", "load"), ("tree", "draft"), ("attention", "attention")):
            got = intersect(rest, cat_u.get(cat, []))
            gaps[what] = length(got) / 1e6
            rest = subtract(rest, union(got))
        gaps["idle"] = length(rest) / 1e6
    return gaps


def _split(window, cat_u: dict) -> dict[str, float]:
    """Each instant of the window to one bucket."""
    split: dict[str, float] = {}
    rest = [window] if window[1] > window[0] else []
    buckets = (("verify", ("verify", "attention")), ("draft", ("draft",)), ("load", ("load",)), ("other", ("other",)))
    for bucket, cats in buckets:
        got = intersect(rest, union([iv for c in cats for iv in cat_u.get(c, [])]))
        split[bucket] = length(got) / 1e6
        rest = subtract(rest, got)
    split["idle"] = length(rest) / 1e6
    return split


def summary_dict(s: TraceSummary) -> dict:
    return {
        "run_id": s.run_id,
        "window_s": s.window_s,
        "tokens": s.tokens,
        "actors": [
            {
                "pid": a.pid,
                "name": a.name,
                "role": a.role,
                "threads": a.threads,
                "busy_s": a.busy_s,
                "busy_pct": a.busy_pct,
                "by_category_s": a.by_category,
                "setup_s": a.setup_s,
                "top_ops": [{"name": n, "count": c, "s": t} for n, c, t in a.top_ops],
            }
            for a in s.actors
        ],
        "io_s": s.io_s,
        "compute_s": s.compute_s,
        "overlap_s": s.overlap_s,
        "overlap_pct": s.overlap_pct,
        "verifier": {
            "busy_s": s.verifier_busy_s,
            "waits": {k: {"count": c, "s": t} for k, (c, t) in s.waits.items()},
            "gaps_s": s.gaps,
        },
        "split_s": s.split_s,
        "per_token_ms": s.per_token_ms,
        "categories_s": s.categories,
    }


def _pct(x: float, whole: float) -> str:
    return f"{100.0 * x / whole:5.1f}%" if whole else "    -"


def format_summary(s: TraceSummary) -> str:
    w = s.window_s
    out = [
        f"trace {s.run_id or '?'}: {w * 1000:.1f} ms of spans, "
        f"{s.tokens if s.tokens is not None else '?'} tokens generated"
    ]
    out += ["", f"{'actor':<32} {'threads':>7} {'busy':>9} {'busy %':>7}  top ops (count, ms)"]
    for a in s.actors:
        top = ", ".join(f"{n} ({c}, {t * 1000:.1f})" for n, c, t in a.top_ops[:3])
        out.append(f"{a.name[:32]:<32} {a.threads:>7} {a.busy_s * 1000:>6.1f} ms {a.busy_pct:>6.1f}%  {top}")
    setup = [f"{a.role} {a.setup_s:.2f} s" for a in s.actors if a.setup_s]
    if setup:
        out.append(f"(setup before the window, e.g. loading weights: {', '.join(setup)})")
    ov = s.overlap_pct
    out += [
        "",
        f"I/O {s.io_s * 1000:.1f} ms, compute {s.compute_s * 1000:.1f} ms, "
        f"both at once {s.overlap_s * 1000:.1f} ms: "
        + (f"{ov:.1f}% of I/O overlapped with compute" if ov is not None else "no I/O spans"),
    ]
    if s.verifier_busy_s or s.waits:
        out += [
            "",
            f"verifier: busy {s.verifier_busy_s * 1000:.1f} ms ({_pct(s.verifier_busy_s, w).strip()} of the window)",
        ]
        for what, (n, t) in s.waits.items():
            out.append(f"  wait:{what:<18} {n:>6} spans {t * 1000:>9.1f} ms {_pct(t, w)}")
        for what, t in s.gaps.items():
            if t > 0:
                why = "waiting for " + what if what != "idle" else "nothing running"
                out.append(f"  gap, {why:<24} {t * 1000:>9.1f} ms {_pct(t, w)}")
    per = s.per_token_ms
    out += [
        "",
        "time split (each instant once: verify > draft > load > other > idle)"
        + (f", per generated token ({s.tokens}):" if per else ":"),
    ]
    for k in SPLIT:
        if k == "other" and not s.split_s.get(k):
            continue
        v = s.split_s.get(k, 0.0)
        out.append(f"  {k:<8} {v * 1000:>9.1f} ms {_pct(v, w)}" + (f"   {per[k]:>8.2f} ms/token" if per else ""))
    if per:
        out.append(f"  {'total':<8} {w * 1000:>9.1f} ms         {sum(per.values()):>8.2f} ms/token")
    others = {c: t for c, t in s.categories.items() if c == "other" and t}
    if others:
        out.append(f"  (spans of unknown categories counted as other: {others['other'] * 1000:.1f} ms)")
    return "\n".join(out)
