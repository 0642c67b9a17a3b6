"""`launch profile`: ARCA profiling on this machine (bench/arca_profile.py); writes a profile that
`launch run --profile` uses: the width, tree and partition with the most expected accepted tokens per
second on this machine and draft.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from bench.measure import machine
from common.paths import check_output
from engine.prompts import DEFAULT_PROMPTS, load_prompts
from pulls import registry
from speculative.arca import WIDTHS


def add_parser(sub):
    p = sub.add_parser("profile", help="ARCA: measure this machine and choose width, tree and partition")
    p.add_argument("--target", default=registry.DEFAULT_TARGET)
    p.add_argument("--draft", default=registry.DEFAULT_DRAFT)
    p.add_argument("--dtype", "--format", dest="fmt", default="int4")
    p.add_argument("--prompts", default=str(DEFAULT_PROMPTS), help="calibration prompts (JSONL)")
    p.add_argument("--tokens", type=int, default=32, help="target tokens per calibration prompt")
    p.add_argument("--out", required=True, help="where to write PROFILE.json")
    p.set_defaults(func=cmd_profile)


def cmd_profile(args) -> int:
    check_output(args.out, "--out")
    prompts = load_prompts(args.prompts)
    from bench import arca_profile  # torch: not for `launch --help`
    from formats import loading

    target, draft = loading.load(args.target, args.fmt), loading.load(args.draft, args.fmt)
    with Progress(console=Console(stderr=True)) as progress:
        m = arca_profile.measure(target, draft, prompts, args.tokens, progress)
    ranked, ctx = m["ranked"], m["context"]
    best = ranked[0]
    _print(m, ctx, args.fmt)
    profile = {
        "target": args.target,
        "draft": args.draft,
        "format": args.fmt,
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
        "width": best["width"],
        "partition": best["partition"],
        "tree": best.get("tree", {"parents": [], "ranks": []}),
        "expected_tokens_per_s": best["tokens_per_s"],
        "acceptance": [[round(x, 4) for x in row] for row in m["acceptance"]],
        "step_s": m["step_s"],
        "draft_level_s": m["draft_level"],
        "candidates": ranked[:20],
        "unit_ms": {
            "|".join(map(str, k)): round(v * 1e3, 4)
            for k, v in {
                **{("2t",) + k: v for k, v in m["both"].items()},
                **{("1t",) + k: v for k, v in m["one"].items()},
            }.items()
        },
    }
    Path(args.out).write_text(json.dumps(profile, indent=1))
    why = (
        "the target alone: no tree pays for its draft and verification on this machine"
        if best["width"] == 0
        else f"width {best['width']}, {best['partition']}: {best['expected']:.2f} tokens expected per verification"
    )
    print(f"chose {why}; wrote {args.out}", file=sys.stderr)
    return 0


def _print(m: dict, ctx: int, fmt: str) -> None:
    ranked, best = m["ranked"], m["ranked"][0]
    t = Table(title=f"ARCA on {machine()} (context {ctx}, {fmt})")
    for c in ("width", "partition", "E[accepted]", "draft ms", "verify ms", "tokens/s"):
        t.add_column(c)
    for r in sorted(ranked, key=lambda r: (r["width"], r["partition"])):
        mark = " *" if r is best else ""
        t.add_row(
            str(r["width"]),
            r["partition"],
            f"{r['expected']:.2f}",
            f"{r['draft_s'] * 1e3:.0f}",
            f"{r['verify_s'] * 1e3:.0f}",
            f"{r['tokens_per_s']:.2f}{mark}",
        )
    Console().print(t)
    units = Table(
        title="one target layer per unit (ms): linear work, dense and sparse attention at context " + str(ctx)
    )
    for c in ("rows", "linear 2 cores", "linear 1 core", "dense 1 core", "sparse 1 core"):
        units.add_column(c)
    both, one = m["both"], m["one"]
    for width in WIDTHS:
        rows = width + 1
        units.add_row(
            str(rows),
            *[
                f"{v * 1e3:.2f}"
                for v in (
                    both[("linear", rows)],
                    one[("linear", rows)],
                    one[("dense", rows, ctx)],
                    one[("sparse", rows, ctx)],
                )
            ],
        )
    Console().print(units)
