"""`launch bench --cgroup`: each mode, and llama.cpp, inside a memory cgroup whose limit is the budget.

The physical proof of a memory budget. Each run is a process of its own, started inside a fresh
memory cgroup (v1 or v2) after the model files' cached pages were evicted (pages cached outside
the cgroup are not charged to it): our modes as `launch run` (the scheduler as a user runs it:
torch-free, the actors forked from one zygote), llama.cpp as `python -m launch.bench.baselines` (its
library and a tokenizer, nothing of ours). Every run gets the same limit.

Reported per run: tokens/s per prompt kind and the ratios to `stdpl` and to llama.cpp; the
cgroup's peak (the page cache fills any limit, so it is the limit when the model streams), the
peak of what the processes hold (anonymous + shared memory) against the plan's figure, each
process's share of it; read GB/s, the loader's busy share of the wall time, the verifier's wait
for I/O.

Modes: std, stdpl, chain, tree, and `nodraft` (tree with `--draft none`: the n-gram trie alone).
A mixture of experts runs each mode once per `--experts` variant (EVICTION+PRELOAD, e.g. none+none
for loading experts on demand, lru+router, edgemoe+paths), labelled `stdpl/lru+router`.
"""
from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
from pathlib import Path

from cadence.errors import CadenceError
from launch.prompts import Prompt

MODES = ("std", "stdpl", "chain", "tree", "nodraft")
MiB = 1 << 20


def label(row: dict) -> str:
    """A row's run: its mode, `nodraft` for tree with no draft model, and a mixture of experts' buffer policies."""
    mode = "nodraft" if row["mode"] == "tree" and row.get("draft") is None else row["mode"]
    return f"{mode}/{row['experts']}" if row.get("experts") and row["mode"] != "llama.cpp" else mode


def expert_variants(text: str | None) -> list[tuple[str, ...]]:
    """`--experts none+none,lru+router,lru+router+bits` -> [(eviction, preload[, "bits"]), ...]; None: the
    run's defaults only. `+bits`: the store with expert-wise bitwidths (`--bits-target`) instead of the target."""
    from launch.runner import RunConfig

    if not text:
        return [(RunConfig.expert_eviction, RunConfig.expert_preload)]
    out = []
    for v in text.split(","):
        parts = tuple(v.strip().split("+"))
        if len(parts) not in (2, 3) or parts[0] not in ("none", "lru", "edgemoe") or parts[1] not in ("none", "paths", "router") \
                or parts[2:] not in ((), ("bits",)):
            raise CadenceError(f"--experts {v.strip()!r} is not EVICTION+PRELOAD[+bits] (eviction lru, edgemoe or none; "
                               "preload none, paths or router), e.g. lru+router")
        out.append(parts)
    return out


def _prompt_file(prompts: list[Prompt], d: Path) -> Path:
    path = d / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": p.id, "kind": p.kind, "prompt": p.text, **({"chat": p.chat} if p.chat is not None else {})})
                            + "\n" for p in prompts))
    return path


def _run_args(args, mode: str, budget: int) -> list[str]:
    """`launch run` arguments for one of our modes, every model and tree option passed on."""
    a = ["--mode", "tree" if mode == "nodraft" else mode, "--memory-budget", str(budget),
         "--target", args.target, "--draft", "none" if mode == "nodraft" else args.draft, "--dtype", args.fmt,
         "--max-new-tokens", str(args.max_new_tokens), "--chat", args.chat, "--threads", str(args.threads),
         "--width", str(args.width), "--chain-k", str(args.chain_k), "--branch-threshold", str(args.branch_threshold),
         "--alpha", str(args.alpha), "--draft-ahead", str(args.draft_ahead), "--draft-window", str(args.draft_window),
         "--no-monitor"]
    for flag, value in (("--draft-dtype", args.draft_fmt), ("--draft-vocab", args.draft_vocab), ("--context", args.context),
                        ("--profile", args.profile), ("--trace-dir", args.trace_dir)):
        if value is not None:
            a += [flag, str(value)]
    return a + (["--no-trie"] if args.no_trie else []) + (["--fixed-width"] if args.fixed_width else [])


def bench_cgroup(args, prompts: list[Prompt], baselines: list[str]):
    from launch.bench.cgroup import run_in_cgroup
    from launch.options import run_config
    from launch.runner import memory_plan
    from models.convert import ensure_store, resolve
    from scheduler.generation.memplan import parse_bytes

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise CadenceError(f"mode {bad[0]} cannot run under --cgroup; use {', '.join(MODES)}")
    from launch.runner import pick_draft

    cfg = run_config(args, "tree")
    tstore = ensure_store(cfg.target, cfg.fmt)
    if cfg.draft == "auto":
        cfg = dataclasses.replace(cfg, draft=pick_draft(cfg, tstore))
        args.draft = cfg.draft
    dstore = ensure_store(cfg.draft, cfg.draft_fmt or cfg.fmt) if cfg.draft != "none" else None
    budget = memory_plan(cfg, tstore, dstore).budget if args.memory_budget == "auto" else parse_bytes(args.memory_budget)
    files = [f for d in {tstore.dir, *([dstore.dir] if dstore else [])} for f in sorted(Path(d).iterdir()) if f.is_file()]
    gguf = resolve(cfg.target)[1]
    base_budget = budget
    if args.baseline_budget == "half-gguf":
        base_budget = gguf.stat().st_size // 2
    elif args.baseline_budget:
        base_budget = parse_bytes(args.baseline_budget)
    print(f"cgroup bench: {budget / MiB:.0f} MiB for every mode; target store {tstore.path.stat().st_size / MiB:.0f} MiB, "
          f"GGUF {gguf.stat().st_size / MiB:.0f} MiB", file=sys.stderr, flush=True)
    rows, runs = [], []
    with tempfile.TemporaryDirectory(prefix="cadence-cgroup-bench-") as tmp:
        pfile = _prompt_file(prompts, Path(tmp))
        variants = expert_variants(getattr(args, "experts", None)) if tstore.args.moe else [None]
        if any(v and v[2:] for v in variants) and not getattr(args, "bits_target", None):
            raise CadenceError("an --experts variant with +bits needs --bits-target: the weight store `launch models "
                               "expert-bits` wrote")
        todo = [(m if v is None else f"{m}/{'+'.join(v)}",
                 [sys.executable, "-m", "launch.cli", "run", "--prompts", str(pfile), *_run_args(args, m, budget),
                  *([] if v is None else ["--expert-eviction", v[0], "--expert-preload", v[1],
                                          "--expert-preload-k", str(args.expert_preload_k)]),
                  *(["--target", args.bits_target] if v and v[2:] else [])],
                 files + ([f for f in sorted(Path(args.bits_target).iterdir()) if f.is_file()] if v and v[2:] else []), budget)
                for m in modes for v in variants]
        todo += [(b, [sys.executable, "-m", "launch.bench.baselines", "--target", args.target, "--dtype", args.fmt,
                      "--prompts", str(pfile), "--max-new-tokens", str(args.max_new_tokens), "--threads", str(args.threads),
                      "--chat", args.chat, *(["--no-repack"] if args.no_repack else [])], [gguf], base_budget)
                 for b in baselines if b == "llama.cpp"]
        for name, argv, evict, limit in todo:
            out = Path(tmp) / f"{name}.json"
            print(f"cgroup bench: {name} under {limit / MiB:.0f} MiB", file=sys.stderr, flush=True)
            run = run_in_cgroup([*argv, "--json", str(out)], limit, evict=evict, capture=True)
            runs.append((name, run, limit))
            if run.returncode != 0 or not out.exists():
                why = "killed by the cgroup's OOM killer" if run.oom_killed else f"exit code {run.returncode}"
                tail = (run.stderr or "").strip().splitlines()[-3:]
                print(f"cgroup bench: {name} failed under the limit ({why}); its rows are missing\n  " + "\n  ".join(tail),
                      file=sys.stderr, flush=True)
                continue
            for r in json.loads(out.read_text()):
                r.update(memory_budget_bytes=limit, peak_memory_bytes=run.peak_bytes, peak_held_bytes=run.peak_held_bytes)
                rows.append(r)
                print(f"  {r['id']:<14} {label(r):<9} {len(r['new_token_ids']):>4} tokens {r['tokens_per_s']:>7.2f} tok/s",
                      file=sys.stderr, flush=True)
    return rows, {"lossless": lossless(rows), "tables": tables(rows, runs)}


def lossless(rows: list[dict]) -> dict:
    """Per run: did it give std's token ids (stdpl's when std did not run; the first run of a mixture of
    experts) on every prompt?"""
    names = list(dict.fromkeys(label(r) for r in rows if r["mode"] != "llama.cpp"))
    ref_mode = "std" if "std" in names else "stdpl" if "stdpl" in names else names[0] if names else ""
    ref = {r["id"]: r["new_token_ids"] for r in rows if label(r) == ref_mode}
    out: dict[str, list[bool]] = {}
    for r in rows:
        if label(r) != ref_mode and r["mode"] != "llama.cpp" and r["id"] in ref:
            out.setdefault(label(r), []).append(r["new_token_ids"] == ref[r["id"]])
    return {m: all(v) for m, v in out.items()}


def _rate(rs: list[dict]) -> float:
    wall = sum(r["wall_s"] for r in rs)
    return sum(len(r["new_token_ids"]) for r in rs) / wall if wall else 0.0


def tables(rows: list[dict], runs: list) -> dict:
    kinds = list(dict.fromkeys(r["kind"] for r in rows))
    names = list(dict.fromkeys(label(r) for r in rows))
    rate = {(n, k): _rate([r for r in rows if label(r) == n and (k == "all" or r["kind"] == k)])
            for n in names for k in [*kinds, "all"]}
    first = next((n for n in names if n != "llama.cpp"), "stdpl")
    ref = "stdpl" if "stdpl" in names else first  # a mixture of experts: its first variant (on demand, where it ran)
    speed = [["run", *kinds, "all", f"/ {ref}", "/ llama.cpp", "accepted / verification"]]
    for n in names:
        rs = [r for r in rows if label(r) == n]
        ver = sum(r["stats"].get("verifications", 0) for r in rs)
        acc = sum(r["stats"].get("accepted", 0) for r in rs)
        ratio = lambda ref: f"{rate[(n, 'all')] / rate[(ref, 'all')]:.2f}x" if rate.get((ref, "all")) else "-"
        speed.append([n, *[f"{rate[(n, k)]:.2f}" for k in kinds], f"{rate[(n, 'all')]:.2f}", ratio(ref), ratio("llama.cpp"),
                      f"{acc / ver:.2f}" if ver else ""])
    stream = [["run", "read GB/s", "loader busy % of wall", "verifier waits on I/O % of wall", "MB read / token"]]
    for n in names:
        rs = [r for r in rows if label(r) == n]
        wall = sum(r["wall_s"] for r in rs)
        toks = sum(len(r["new_token_ids"]) for r in rs)
        byt = sum(r["stats"].get("bytes_read", 0) for r in rs)
        rd = sum(r["stats"].get("read_s", 0.0) for r in rs)
        wait = sum(r["stats"].get("io_wait_s", 0.0) for r in rs)
        if rd:
            stream.append([n, f"{byt / rd / 1e9:.2f}", f"{100 * rd / wall:.0f}", f"{100 * wait / wall:.0f}", f"{byt / toks / 1e6:.0f}"])
    memory = [["run", "limit MiB", "cgroup peak MiB", "held peak MiB (anon + shmem)", "plan held MiB", "OOM kill", "exit",
               "held by process near the peak (MiB)"]]
    for name, run, limit in runs:
        plan = next((r.get("memory_plan", {}).get("held_bytes") for r in rows if label(r) == name), None)
        procs = ", ".join(f"{p.removeprefix('cad-')} {b / MiB:.0f}" for p, b in sorted((run.held_by_process or {}).items(), key=lambda x: -x[1]))
        memory.append([name, f"{limit / MiB:.0f}", f"{run.peak_bytes / MiB:.0f}", f"{run.peak_held_bytes / MiB:.0f}",
                       f"{plan / MiB:.0f}" if plan else "-", "yes" if run.oom_killed else "no", str(run.returncode), procs])
    out = {"tokens/s under the limit": speed, "streaming": stream, "memory": memory}
    experts = [["run", "hit rate", "preloads", "of them used", "expert reads / token", "expert MB read / token", "waits on experts % of wall"]]
    for n in names:
        rs = [r for r in rows if label(r) == n and "expert_requests" in r["stats"]]
        if rs:
            g = lambda k: sum(r["stats"].get(k, 0) for r in rs)
            toks, wall = sum(len(r["new_token_ids"]) for r in rs), sum(r["wall_s"] for r in rs)
            asked = g("expert_hits") + g("expert_misses")
            experts.append([n, f"{g('expert_hits') / asked:.3f}" if asked else "-", str(g("expert_preloads")),
                            str(g("expert_preload_hits")), f"{g('expert_reads') / toks:.1f}",
                            f"{g('expert_bytes_read') / toks / 1e6:.0f}", f"{100 * g('expert_wait_s') / wall:.0f}"])
    if len(experts) > 1:
        out["experts"] = experts
    return out
