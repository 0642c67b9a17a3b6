"""`launch runtime-bench`: the actor runtime's benchmark (bench/runtime.py; BENCHMARKS.md, "Actor runtime"):
the control round trip, the tensor handoff by size against pickling, this machine's memcpy."""

from __future__ import annotations

import json


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("runtime-bench", help="benchmark the actor runtime: control RTT, tensor handoff, memcpy")
    p.add_argument("--json", metavar="OUT", help="also write the results as JSON to OUT")
    p.add_argument("--rounds", type=int, default=5000, help="round trips timed for the RTT (default 5000)")
    p.add_argument("--max-mib", type=int, default=256, help="largest tensor handed off, in MiB (default 256)")
    p.add_argument("--memcpy-mib", type=int, default=256, help="buffer size for the memcpy reference (default 256)")
    p.set_defaults(func=run)


def run(args) -> int:
    from bench.runtime import format_table, measure

    out = measure(args.rounds, args.max_mib, args.memcpy_mib)
    print(format_table(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0
