"""`launch trace summary|html`: read a run's Chrome trace (traces/<run-id>.json)."""

from __future__ import annotations

import json
from pathlib import Path

from common.errors import CadenceError
from observe.trace_html import write_html
from observe.summary import format_summary, summarize, summary_dict
from observe.traces import load_trace, not_a_trace
from scheduler.trace import validate_trace


def add_parser(sub):
    p = sub.add_parser("trace", help="summarize a run's trace, or turn it into one HTML page")
    tsub = p.add_subparsers(dest="trace_cmd", metavar="ACTION", required=True)
    ps = tsub.add_parser("summary", help="busy %% per actor, compute/I-O overlap, verifier waits, time per token")
    ps.add_argument("trace", help="a trace file, e.g. traces/<run-id>.json")
    ps.add_argument("--tokens", type=int, help="tokens generated (default: the trace's `tokens` counter)")
    ps.add_argument("--json", action="store_true", help="print the figures as JSON")
    ps.set_defaults(func=cmd_summary)
    ph = tsub.add_parser("html", help="a self-contained HTML timeline (no network needed)")
    ph.add_argument("trace", help="a trace file, e.g. traces/<run-id>.json")
    ph.add_argument("-o", "--out", help="the HTML file to write (default: next to the trace, .html)")
    ph.add_argument("--title", help="the page title")
    ph.set_defaults(func=cmd_html)


def _read(path: str) -> dict:
    p = Path(path)
    where = "runs write theirs to traces/<run-id>.json"
    if not p.is_file():
        raise CadenceError(f"no trace file at {p} ({where})")
    if p.stat().st_size == 0:
        raise CadenceError(f"{p} is empty, not a trace ({where})")
    try:
        trace = load_trace(p)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CadenceError(f"{p} is not a JSON trace ({e}); {where}") from None
    why = not_a_trace(trace)
    if why:
        raise CadenceError(
            f"{p} is not a trace: {why}; give the trace a run wrote (traces/<run-id>.json, named on its `trace:` line)"
        )
    return trace


def cmd_summary(args) -> int:
    trace = _read(args.trace)
    s = summarize(trace, tokens=args.tokens)
    if args.json:
        print(json.dumps(summary_dict(s), indent=2))
        return 0
    print(format_summary(s))
    problems = validate_trace(trace)
    if problems:
        print(f"\nnote: {len(problems)} event(s) would be misdrawn by trace viewers, e.g. {problems[0]}")
    return 0


def cmd_html(args) -> int:
    _read(args.trace)  # a clear error before anything is written
    out = write_html(args.trace, args.out, args.title)
    print(f"{out} ({out.stat().st_size / 1e6:.1f} MB): open it in any browser, no network needed")
    return 0
