"""`launch bench`: our modes and other engines side by side in one run, ratios per prompt kind.

The suites are bench/suites.py (and bench/in_cgroup.py under `--cgroup`). `--json OUT` writes the
same rows as `launch run --json`, each with its `mode`; other measurements go to `OUT.extra.json`.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from rich.console import Console

from bench import suites
from bench.measure import machine
from bench.peers import check_installed
from bench.report import failures, print_table, summary_table
from common.errors import CadenceError
from common.paths import check_output
from engine.prompts import DEFAULT_PROMPTS, load_prompts
from engine.rows import write_rows
from launch.options import add_run_options, run_config

BASELINES = ("hf", "hf-assisted", "hf-prompt-lookup", "llama.cpp")


def add_parser(sub):
    p = sub.add_parser("bench", help="benchmark modes and engines side by side")
    p.add_argument("--suite", default="modes", choices=suites.SUITES)
    p.add_argument(
        "--modes",
        default=None,
        help="our modes (suite modes); default target,chain,tree, or std,stdpl,chain,tree under --memory-budget",
    )
    p.add_argument(
        "--baselines",
        default="auto",
        help="comma list of hf,hf-assisted,hf-prompt-lookup,llama.cpp, 'none', or 'auto' (all installed)",
    )
    p.add_argument("--hf-dtype", default="bf16", choices=("bf16", "fp32", "fp16"))
    p.add_argument("--formats", default="fp32,bf16,int8,int4", help="suite formats: weight formats to compare")
    p.add_argument("--prompts", default=str(DEFAULT_PROMPTS), help="JSONL prompt set")
    p.add_argument("--limit", type=int, default=0, help="only the first N prompts")
    p.add_argument(
        "--one-per-kind", action="store_true", help="only the first prompt of each kind (complete, copy, open, ...)"
    )
    p.add_argument(
        "--cgroup",
        action="store_true",
        help="with --memory-budget: run each mode (and llama.cpp) in its own memory cgroup limited to the "
        "budget, the model files evicted from the page cache first; rows get peak_memory_bytes (root)",
    )
    p.add_argument(
        "--baseline-budget",
        default=None,
        help="with --cgroup: llama.cpp's own limit (bytes, 560MiB, or 'half-gguf': half its GGUF file); "
        "default: the same budget as our modes",
    )
    p.add_argument(
        "--no-repack",
        action="store_true",
        help="llama.cpp without its weight repacking (a repacked copy does not fit under a memory limit)",
    )
    p.add_argument(
        "--experts",
        default=None,
        metavar="EVICTION+PRELOAD,...",
        help="with --cgroup and a mixture-of-experts target: run each mode once per expert buffer policy, "
        "e.g. none+none,lru+none,edgemoe+none,edgemoe+paths,lru+router (none+none: experts read on demand)",
    )
    p.add_argument(
        "--bits-target",
        default=None,
        metavar="STORE",
        help="with --experts ...+bits: the weight store with expert-wise bitwidths (launch models expert-bits)",
    )
    p.add_argument("--json", dest="json_out", help="write the rows here")
    add_run_options(p, max_new_tokens=128)  # a benchmark compares fixed lengths
    p.set_defaults(func=cmd_bench)


def baselines(arg: str) -> tuple[str, ...]:
    from bench.baselines import available

    if arg == "none":
        return ()
    if arg == "auto":
        return tuple(n for n in BASELINES if available("hf" if n.startswith("hf") else n))
    chosen = tuple(x.strip() for x in arg.split(",") if x.strip())
    bad = [x for x in chosen if x not in BASELINES]
    if bad:
        raise CadenceError(f"unknown baseline {bad[0]}; use {', '.join(BASELINES)}")
    check_installed(list(chosen))
    return chosen


def cmd_bench(args) -> int:
    # each mode's plan from the rule of thumb, not from what the modes run before it measured (engine/acceptance.py);
    # CADENCE_LEARN=1 in the environment measures the plans this machine's history makes
    os.environ.setdefault("CADENCE_LEARN", "0")
    if args.json_out:
        check_output(args.json_out, "--json")
    prompts = load_prompts(args.prompts)
    if args.one_per_kind:
        prompts = [p for i, p in enumerate(prompts) if p.kind not in {q.kind for q in prompts[:i]}]
    if args.limit:
        prompts = prompts[: args.limit]
    modes = args.modes or ("std,stdpl,chain,tree" if args.memory_budget else "target,chain,tree")
    opts = suites.BenchOptions(
        tuple(m.strip() for m in modes.split(",") if m.strip()),
        baselines(args.baselines),
        args.hf_dtype,
        tuple(f.strip() for f in args.formats.split(",") if f.strip()),
        repack=not args.no_repack,
    )
    cfg = run_config(args)
    if args.cgroup:
        if args.suite != "modes" or not args.memory_budget:
            raise CadenceError(
                "--cgroup proves a memory budget: use it with --suite modes and --memory-budget (e.g. auto)"
            )
        from bench.in_cgroup import CgroupOptions, bench_cgroup

        rows, extra = bench_cgroup(
            cfg, prompts, opts, CgroupOptions(args.baseline_budget, args.experts, args.bits_target, args.draft)
        )
    else:
        rows, extra = getattr(suites, args.suite)(cfg, prompts, opts)
    report(args, rows, extra, len(prompts))
    return 0


def report(args, rows: list[dict], extra: dict, n_prompts: int) -> None:
    console = Console()
    console.print(
        f"machine: {machine()}; {n_prompts} prompts, {args.max_new_tokens} new tokens, {time.strftime('%Y-%m-%d')}"
    )
    if not args.cgroup and rows:
        print_table(console, "tokens/s (ratio to our target mode, same weights)", summary_table(rows))
    for line in failures(rows):
        console.print(line)
    if extra.get("lossless"):
        console.print(
            "lossless (token ids equal the reference mode's on every prompt, greedy or with the same seed): "
            + ", ".join(f"{m} {'yes' if ok else 'NO'}" for m, ok in extra["lossless"].items())
        )
    for title, table in extra.get("tables", {}).items():
        print_table(console, title, table)
    if args.json_out:
        write_rows(args.json_out, rows)
        Path(args.json_out + ".extra.json").write_text(json.dumps({**extra, "machine": machine()}, indent=1))
        print(f"wrote {len(rows)} rows to {args.json_out}", file=sys.stderr)
        if rows:
            from bench.chart import write_chart

            chart = write_chart(
                rows,
                Path(args.json_out).with_suffix(".html"),
                f"cadence bench ({args.suite}), {time.strftime('%Y-%m-%d')}",
            )
            print(f"chart: {chart}", file=sys.stderr)
