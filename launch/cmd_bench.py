"""`launch bench`: our modes and other engines side by side in one run, ratios per prompt kind.

Suites:
  modes    target, chain, tree (one actor runtime, same weights) + HF transformers target-only,
           assisted generation and prompt lookup + llama.cpp, on a prompt set (issue 5)
  formats  target-only tokens/s per weight format for the 1.5B and the 0.5B + llama.cpp, the cost of
           one verification pass at widths 1..64 per format, and quality (mean log-likelihood) (issue 3)
  engine   our target-only fp32/bf16 against HF transformers fp32/bf16 (issue 2)
  attention  one layer's tree attention: dense masked, naive sparse, our sparse kernel, the
           verifier/worker split (issue 7; launch/bench/attention.py)
Prompts run one after another and, for each prompt, every engine in turn, so the background
load of a shared machine falls on all of them alike. `--json OUT` writes the same rows as
`launch run --json`, each with its `mode`; other measurements go to `OUT` with `.extra.json`.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

from rich.console import Console
from rich.table import Table

from cadence.errors import CadenceError
from cadence.paths import check_output
from launch.bench import baselines
from launch.bench.measure import RTT_S, machine
from launch.options import add_model_args, run_config, setup_threads
from launch.prompts import DEFAULT_PROMPTS, Prompt, load_prompts, prompt_ids
from launch.results import write_rows
from launch.runner import Runner

SUITES = ("modes", "formats", "engine", "attention")


def add_parser(sub):
    p = sub.add_parser("bench", help="benchmark modes and engines side by side")
    p.add_argument("--suite", default="modes", choices=SUITES)
    p.add_argument("--modes", default=None,
                   help="our modes (suite modes); default target,chain,tree, or std,stdpl,chain,tree under --memory-budget")
    p.add_argument("--baselines", default="auto",
                   help="comma list of hf,hf-assisted,hf-prompt-lookup,llama.cpp, 'none', or 'auto' (all installed)")
    p.add_argument("--hf-dtype", default="bf16", choices=("bf16", "fp32", "fp16"))
    p.add_argument("--formats", default="fp32,bf16,int8,int4", help="suite formats: weight formats to compare")
    p.add_argument("--prompts", default=str(DEFAULT_PROMPTS), help="JSONL prompt set")
    p.add_argument("--limit", type=int, default=0, help="only the first N prompts")
    p.add_argument("--one-per-kind", action="store_true", help="only the first prompt of each kind (complete, copy, open, ...)")
    add_model_args(p)
    p.add_argument("--cgroup", action="store_true",
                   help="with --memory-budget: run each mode (and llama.cpp) in its own memory cgroup limited to the "
                        "budget, the model files evicted from the page cache first; rows get peak_memory_bytes (root)")
    p.add_argument("--baseline-budget", default=None,
                   help="with --cgroup: llama.cpp's own limit (bytes, 560MiB, or 'half-gguf': half its GGUF file); "
                        "default: the same budget as our modes")
    p.add_argument("--no-repack", action="store_true",
                   help="llama.cpp without its weight repacking (a repacked copy does not fit under a memory limit)")
    p.add_argument("--experts", default=None, metavar="EVICTION+PRELOAD,...",
                   help="with --cgroup and a mixture-of-experts target: run each mode once per expert buffer policy, "
                        "e.g. none+none,lru+none,edgemoe+none,edgemoe+paths,lru+router (none+none: experts read on demand)")
    p.add_argument("--bits-target", default=None, metavar="STORE",
                   help="with --experts ...+bits: the weight store with expert-wise bitwidths (launch models expert-bits)")
    p.add_argument("--json", dest="json_out", help="write the rows here")
    p.set_defaults(func=cmd_bench)


def _baselines(arg: str) -> list[str]:
    names = [*baselines.HF_MODES, "llama.cpp"]
    if arg == "none":
        return []
    if arg == "auto":
        return [n for n in names if baselines.available("hf" if n.startswith("hf") else n)]
    chosen = [x.strip() for x in arg.split(",") if x.strip()]
    bad = [x for x in chosen if x not in names]
    if bad:
        raise CadenceError(f"unknown baseline {bad[0]}; use {', '.join(names)}")
    for x in chosen:
        if not baselines.available("hf" if x.startswith("hf") else x):
            raise CadenceError(f"baseline {x} needs its package installed ({'transformers and accelerate' if x.startswith('hf') else 'llama-cpp-python'})")
    return chosen


def cmd_bench(args) -> int:
    if args.json_out:
        check_output(args.json_out, "--json")
    setup_threads(args)
    prompts = load_prompts(args.prompts)
    if args.one_per_kind:
        prompts = [p for i, p in enumerate(prompts) if p.kind not in {q.kind for q in prompts[:i]}]
    if args.limit:
        prompts = prompts[:args.limit]
    if args.modes is None:
        args.modes = "std,stdpl,chain,tree" if args.memory_budget else "target,chain,tree"
    if args.cgroup and (args.suite != "modes" or not args.memory_budget):
        raise CadenceError("--cgroup proves a memory budget: use it with --suite modes and --memory-budget (e.g. auto)")
    if args.cgroup:
        from launch.bench.in_cgroup import bench_cgroup

        rows, extra = bench_cgroup(args, prompts, _baselines(args.baselines))
    else:
        suite = {"modes": bench_modes, "formats": bench_formats, "engine": bench_engine, "attention": bench_attention}[args.suite]
        rows, extra = suite(args, prompts)
    console = Console()
    console.print(f"machine: {machine()}; {len(prompts)} prompts, {args.max_new_tokens} new tokens, {time.strftime('%Y-%m-%d')}")
    if not args.cgroup:
        print_summary(console, rows)
    if extra.get("lossless"):
        console.print("lossless (greedy token ids equal the reference mode's on every prompt): " +
                      ", ".join(f"{m} {'yes' if ok else 'NO'}" for m, ok in extra["lossless"].items()))
    for title, table in extra.get("tables", {}).items():
        print_table(console, title, table)
    if args.json_out:
        write_rows(args.json_out, rows)
        Path(args.json_out + ".extra.json").write_text(json.dumps({**extra, "machine": machine()}, indent=1))
        print(f"wrote {len(rows)} rows to {args.json_out}", file=sys.stderr)
        if rows:
            from launch.bench.chart import write_chart

            chart = write_chart(rows, Path(args.json_out).with_suffix(".html"), f"cadence bench ({args.suite}), {time.strftime('%Y-%m-%d')}")
            print(f"chart: {chart}", file=sys.stderr)
    return 0


def print_table(console: Console, title: str, table: list[list]) -> None:
    """A table on the terminal; piped, as Markdown with nothing cut (BENCHMARKS.md takes it as it is)."""
    if not console.is_terminal:
        print(f"\n{title}\n")
        print("| " + " | ".join(str(c) for c in table[0]) + " |")
        print("|" + "---|" * len(table[0]))
        for r in table[1:]:
            print("| " + " | ".join(str(x) for x in r) + " |")
        return
    t = Table(title=title)
    for c in table[0]:
        t.add_column(str(c))
    for r in table[1:]:
        t.add_row(*[str(x) for x in r])
    console.print(t)


def _progress(row: dict):
    print(f"  {row['id']:<14} {row['mode']:<17} {len(row['new_token_ids']):>4} tokens {row['tokens_per_s']:>7.2f} tok/s",
          file=sys.stderr, flush=True)


class _Baselines:
    """The other engines a bench compares with, loaded once, each producing our rows."""

    def __init__(self, args, base: list[str], tok):
        self.base, self.tok, self.args = base, tok, args
        self.hf = baselines.HFBaseline(args.target, args.draft, args.hf_dtype) if any(b.startswith("hf") for b in base) else None
        self.lcpp = baselines.LlamaCppBaseline(args.target, args.threads or os.cpu_count(), repack=not args.no_repack) \
            if "llama.cpp" in base else None

    def run_all(self, p: Prompt, ids: list[int], chat: bool, rows: list[dict]) -> None:
        a, tok = self.args, self.tok
        for b in self.base:
            if b.startswith("hf"):
                rows.append(self.hf.run(b, p, ids, chat, a.max_new_tokens, tok.stop_ids, tok.decode))
            else:
                rows.append(self.lcpp.run(p, ids, chat, a.max_new_tokens, tok.stop_ids, tok.decode))
            _progress(rows[-1])


def bench_modes(args, prompts: list[Prompt]):
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    base = _baselines(args.baselines)
    rows = []
    if not modes:  # baselines alone (a cgroup child): no model of ours in memory
        from models.convert import ensure_store
        from models.tokenizer import TextTokenizer

        tok = TextTokenizer(ensure_store(args.target, args.fmt).tokenizer_info)
        others = _Baselines(args, base, tok)
        for p in prompts:
            others.run_all(p, *prompt_ids(tok, p, args.chat), rows)
        return rows, {}
    cfg = run_config(args, "tree" if any(m not in ("target", "std", "stdpl") for m in modes) else modes[0])
    with Runner(cfg, prompts) as runner:
        others = _Baselines(args, base, runner.tokenizer)
        for p in prompts:
            ids, chat = runner.prompt_ids(p)
            for m in modes:
                rows.append(runner.run(p, mode=m))
                _progress(rows[-1])
            others.run_all(p, ids, chat, rows)
    return rows, {"lossless": lossless_check(rows)}


def lossless_check(rows: list[dict], ref_mode: str = "target") -> dict:
    """Per prompt: does every greedy mode of ours give the reference mode's token ids?"""
    ref = {r["id"]: r["new_token_ids"] for r in rows if r["mode"] == ref_mode}
    out = {}
    for r in rows:
        if r["mode"] in ("chain", "tree", "stdpl") and r["mode"] != ref_mode and r["id"] in ref:
            out.setdefault(r["mode"], []).append(r["new_token_ids"] == ref[r["id"]])
    return {m: all(v) for m, v in out.items()}


def print_summary(console: Console, rows: list[dict]):
    """tokens/s (total tokens / total time) per mode and prompt kind, ratio to `target`."""
    groups: dict[tuple, list] = defaultdict(list)
    for r in rows:
        fmt = r["format"]
        for kind in (r["kind"], "all"):
            groups[(r["mode"], fmt, r["target"], kind)].append(r)
    kinds = sorted({k[3] for k in groups} - {"all"}) + ["all"]
    rate = {k: sum(len(r["new_token_ids"]) for r in v) / max(sum(r["wall_s"] for r in v), 1e-9) for k, v in groups.items()}
    t = Table(title="tokens/s (ratio to our target mode, same weights)")
    for c in ("mode", "format", "model", *kinds, "acc/verif", "verif/token", "wasted/token", "ahead reused/verif"):
        t.add_column(c)
    for mode, fmt, target in sorted({k[:3] for k in groups}, key=lambda x: (x[2], x[1], x[0])):
        cells = []
        for kind in kinds:
            r = rate.get((mode, fmt, target, kind))
            base = rate.get(("target", fmt, target, kind))
            cells.append("" if r is None else f"{r:.2f}" + (f" ({r / base:.2f}x)" if base and mode != "target" else ""))
        allrows = groups[(mode, fmt, target, "all")]
        n = sum(len(r["new_token_ids"]) for r in allrows)
        ver = sum(r["stats"].get("verifications", 0) for r in allrows)
        acc = sum(r["stats"].get("accepted", 0) for r in allrows)
        wasted = sum(r["stats"].get("wasted", 0) for r in allrows)
        reused = sum(r["stats"].get("ahead_reused", 0) for r in allrows)
        spec = mode in ("chain", "tree")
        t.add_row(mode, fmt, target, *cells, f"{acc / max(ver, 1):.2f}" if spec else "", f"{ver / max(n, 1):.3f}" if spec else "",
                  f"{wasted / max(n, 1):.2f}" if spec else "", f"{reused / max(ver, 1):.2f}" if spec else "")
    console.print(t)


def bench_engine(args, prompts: list[Prompt]):
    """Issue 2: our target-only decode in fp32 and bf16 against HF transformers, 1.5B and 0.5B."""
    rows = []
    for model in (args.target, args.draft):
        for fmt in ("fp32", "bf16"):
            a = _with(args, target=model, fmt=fmt, runtime="inproc")
            cfg = run_config(a, "target")
            with Runner(cfg) as runner:
                hf = baselines.HFBaseline(model, None, fmt) if baselines.available("hf") else None
                tok = runner.tokenizer
                for p in prompts:
                    rows.append(runner.run(p))
                    _progress(rows[-1])
                    if hf:
                        ids, chat = prompt_ids(tok, p, cfg.chat)
                        rows.append(hf.run("hf", p, ids, chat, cfg.max_new_tokens, tok.stop_ids, tok.decode))
                        rows[-1]["mode"] = "target"  # compare under the same mode name, told apart by format
                        _progress(rows[-1])
                del hf
    return rows, {}


def bench_attention(args, prompts: list[Prompt]):
    """Issue 7: the attention of one target layer during tree verification, four ways."""
    from launch.bench import attention
    from models.convert import ensure_store

    table = attention.run(ensure_store(args.target, args.fmt).args, RTT_S, args.threads or os.cpu_count() or 1)
    return [], {"tables": {"tree attention of one layer (us), " + args.target: table}}


def _with(args, **kw):
    import argparse

    return argparse.Namespace(**{**vars(args), **kw})


def bench_formats(args, prompts: list[Prompt]):
    """Issue 3: formats side by side: decode speed, the verifier's cost curve, quality."""
    from launch.bench.quality import cost_curve, mean_loglik

    from models import kernels

    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    rows, curve, quality = [], [["model", "format", "kernel path", *[f"width {w} (ms)" for w in (1, 4, 16, 64)]]], [
        ["model", "format", "mean log-lik", "perplexity", "delta vs bf16"]]
    lcpp_ok = baselines.available("llama.cpp")
    for model in (args.target, args.draft):
        ll = {}
        for fmt in formats:
            cfg = run_config(_with(args, target=model, fmt=fmt, runtime="inproc"), "target")
            with Runner(cfg) as runner:
                for p in prompts:
                    rows.append(runner.run(p))
                    _progress(rows[-1])
                for path in kernels.host_paths():  # every kernel path this CPU has, side by side
                    with kernels.using(kernels.load(path)):
                        costs = cost_curve(runner.target.model, (1, 4, 16, 64))
                    curve.append([model, fmt, path, *[f"{t * 1e3:.1f}" for t in costs]])
                ll[fmt] = mean_loglik(runner.target, prompts)
        for fmt in formats:
            base = ll.get("bf16", ll.get("fp32"))
            quality.append([model, fmt, f"{ll[fmt]:.4f}", f"{math.exp(-ll[fmt]):.3f}",
                            f"{ll[fmt] - base:+.4f}" if base is not None else ""])
        if lcpp_ok:
            lcpp = baselines.LlamaCppBaseline(model, args.threads or os.cpu_count())
            tok = runner.tokenizer
            for p in prompts:
                ids, chat = prompt_ids(tok, p, args.chat)
                rows.append(lcpp.run(p, ids, chat, args.max_new_tokens, tok.stop_ids, tok.decode))
                rows[-1]["mode"] = "target"
                _progress(rows[-1])
            del lcpp
    return rows, {"tables": {"one verification pass (ms) by width": curve, "quality on the prompts": quality}}
