"""`launch bench --cgroup`: each mode, and llama.cpp, inside a memory cgroup whose limit is the budget.

The physical proof of a memory budget. Each run is a process of its own, started inside a fresh
memory cgroup (v1 or v2) after the model files' cached pages were evicted (pages cached outside
the cgroup are not charged to it): our modes as `launch run` (the scheduler as a user runs it:
torch-free, the actors forked from one zygote), llama.cpp as `python -m bench.baselines` (its
library and a tokenizer, nothing of ours). Every run gets the same limit.

Reported per run: tokens/s per prompt kind and the ratios to `stdpl` and to llama.cpp; the
cgroup's peak (the page cache fills any limit, so it is the limit when the model streams), the
peak of what the processes hold (anonymous + shared memory) against the plan's figure, each
process's share of it; read GB/s, the loader's busy share of the wall time, the verifier's wait
for I/O.

Modes: std, stdpl, chain, tree, `nodraft` (tree with `--draft none`: the n-gram trie alone) and `fdraft`
(tree with `--draft flash`: the target's own sparse FFN drafts; `fdraft@D` at `--ffn-density D`); any of them
`:f16` (`tree:f16`) with `--kv-dtype f16`, beside the same mode's f32 caches.
A mixture of experts runs each mode once per `--experts` variant (EVICTION+PRELOAD, e.g. none+none
for loading experts on demand, lru+router, edgemoe+paths), labelled `stdpl/lru+router`.
"""

from __future__ import annotations

import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from common.errors import CadenceError
from common.modes import Mode
from common.settings import ExpertOptions
from engine.config import RunConfig
from engine.options import argv
from engine.inputs import tree_pair
from engine.machine import ThisMachine
from engine.prompts import Prompt
from models.shapes import KV_DTYPES
from bench.cgroup_tables import tables
from bench.report import label, lossless

MODES = (
    Mode.STD,
    Mode.STDPL,
    Mode.CHAIN,
    Mode.TREE,
    "nodraft",
    "fdraft",
    Mode.FLASH,
)  # flash@D: --mode flash --ffn-density D
DRAFTS = {"nodraft": "none", "fdraft": "flash"}  # tree mode with this --draft
MiB = 1 << 20


@dataclass(frozen=True)
class CgroupOptions:
    baseline_budget: str | None = None  # llama.cpp's own limit: bytes, "560MiB", or "half-gguf"; None: the modes'
    experts: str | None = None  # a mixture of experts: EVICTION+PRELOAD[+bits] variants to run each mode with
    bits_target: str | None = None  # the store with expert-wise bitwidths the +bits variants run
    tree_draft: str = "auto"  # the draft tree mode was asked to run with


def expert_variants(text: str | None) -> list[tuple[str, ...]]:
    """`--experts none+none,lru+router,lru+router+bits` -> [(eviction, preload[, "bits"]), ...]; None: the
    run's defaults only. `+bits`: the store with expert-wise bitwidths (`--bits-target`) instead of the target."""
    if not text:
        return [(ExpertOptions.eviction, ExpertOptions.preload)]
    out = []
    for v in text.split(","):
        parts = tuple(v.strip().split("+"))
        if (
            len(parts) not in (2, 3)
            or parts[0] not in ("none", "lru", "edgemoe")
            or parts[1] not in ("none", "paths", "router")
            or parts[2:] not in ((), ("bits",))
        ):
            raise CadenceError(
                f"--experts {v.strip()!r} is not EVICTION+PRELOAD[+bits] (eviction lru, edgemoe or none; "
                "preload none, paths or router), e.g. lru+router"
            )
        out.append(parts)
    return out


def _prompt_file(prompts: list[Prompt], d: Path) -> Path:
    path = d / "prompts.jsonl"
    path.write_text(
        "".join(
            json.dumps(
                {"id": p.id, "kind": p.kind, "prompt": p.text, **({"chat": p.chat} if p.chat is not None else {})}
            )
            + "\n"
            for p in prompts
        )
    )
    return path


def _run_argv(cfg: RunConfig, mode: str, budget: int, variant: tuple[str, ...] | None, c: CgroupOptions) -> list[str]:
    """`launch run` for one of our modes: every option of the run passed on (engine/options.py `argv`)."""
    mode, _, kv = mode.partition(":")
    mode, _, density = mode.partition("@")
    m = cfg.with_mode("tree" if mode in DRAFTS else mode).replace(memory_budget=str(budget))
    if kv:
        m = m.replace(kv_dtype=kv)
    if density:
        m = m.replace(ffn_density=float(density))
    if mode in DRAFTS:
        m = m.replace(draft=DRAFTS[mode])
    elif (
        mode == Mode.TREE and c.tree_draft == "auto"
    ):  # each run settles `auto` as `launch run` does (engine/memory.py)
        m = m.replace(draft="auto")
    if variant is not None:
        m = m.replace(experts=ExpertOptions(variant[0], variant[1], cfg.experts.preload_k))
        if variant[2:]:
            m = m.replace(target=c.bits_target)
    return [sys.executable, "-m", "launch.cli", "run", *argv(m.options()), "--no-monitor"]


def _budgets(cfg: RunConfig, c: CgroupOptions, r, machine) -> tuple[int, int, Path]:
    """(the modes' limit, llama.cpp's limit, its GGUF file)."""
    from engine.memory import memory_plan
    from formats.convert import resolve as source
    from common.units import parse_bytes

    budget = (
        memory_plan(r.cfg, None, r.target, r.draft, machine).budget
        if cfg.memory_budget == "auto"
        else parse_bytes(cfg.memory_budget)
    )
    gguf = source(cfg.target)[1]
    base = (
        gguf.stat().st_size // 2
        if c.baseline_budget == "half-gguf"
        else parse_bytes(c.baseline_budget)
        if c.baseline_budget
        else budget
    )
    return budget, base, gguf


def _todo(cfg: RunConfig, r, prompts_file: Path, opts, c: CgroupOptions, budget: int, base: int, gguf: Path) -> list:
    """Every run: (name, argv, the files to evict from the page cache first, its limit)."""
    files = [
        f for d in {r.target.dir, *([r.draft.dir] if r.draft else [])} for f in sorted(Path(d).iterdir()) if f.is_file()
    ]
    bits = [f for f in sorted(Path(c.bits_target).iterdir()) if f.is_file()] if c.bits_target else []
    variants = expert_variants(c.experts) if r.target.args.moe else [None]
    if any(v and v[2:] for v in variants) and not c.bits_target:
        raise CadenceError(
            "an --experts variant with +bits needs --bits-target: the weight store `launch models expert-bits` wrote"
        )
    todo = [
        (
            m if v is None else f"{m}/{'+'.join(v)}",
            [*_run_argv(r.cfg, m, budget, v, c), "--prompts", str(prompts_file)],
            files + (bits if v and v[2:] else []),
            budget,
        )
        for m in opts.modes
        for v in variants
    ]
    todo += [
        (
            b,
            [
                sys.executable,
                "-m",
                "bench.baselines",
                "--target",
                cfg.target,
                "--dtype",
                cfg.dtype,
                "--prompts",
                str(prompts_file),
                "--max-new-tokens",
                str(cfg.max_new_tokens),
                "--threads",
                str(cfg.threads),
                "--chat",
                cfg.chat,
                *([] if opts.repack else ["--no-repack"]),
            ],
            [gguf],
            base,
        )
        for b in opts.baselines
        if b == "llama.cpp"
    ]
    return todo


def bench_cgroup(cfg: RunConfig, prompts: list[Prompt], opts, c: CgroupOptions):
    from bench.cgroup import run_in_cgroup
    from engine.budget_choice import prepare_drafts

    bad = [m for m in opts.modes if m.partition(":")[0].partition("@")[0] not in MODES]
    bad += [m for m in opts.modes if m.partition(":")[2] not in ("", *KV_DTYPES)]
    if bad:
        raise CadenceError(
            f"mode {bad[0]} cannot run under --cgroup; use {', '.join(MODES)}, each with :f16 for half KV caches"
        )
    say = lambda line: print(f"cgroup bench: {line}", file=sys.stderr, flush=True)  # noqa: E731
    machine = ThisMachine(say)
    r = tree_pair(cfg, machine, prompts)
    budget, base, gguf = _budgets(cfg, c, r, machine)
    if (
        r.draft is not None
        and not r.target.args.moe
        and any(m.partition(":")[0] in (Mode.TREE, Mode.CHAIN) for m in opts.modes)
    ):
        prepare_drafts(cfg.with_mode("tree"), machine)  # here, outside the limit (each run still decides itself)
    print(
        f"cgroup bench: {budget / MiB:.0f} MiB for every mode; target store {r.target.path.stat().st_size / MiB:.0f} "
        f"MiB, GGUF {gguf.stat().st_size / MiB:.0f} MiB",
        file=sys.stderr,
        flush=True,
    )
    rows, runs = [], []
    with tempfile.TemporaryDirectory(prefix="cadence-cgroup-bench-") as tmp:
        for name, run_argv, evict, limit in _todo(
            cfg, r, _prompt_file(prompts, Path(tmp)), opts, c, budget, base, gguf
        ):
            out = Path(tmp) / f"{name.replace('/', '_')}.json"
            print(f"cgroup bench: {name} under {limit / MiB:.0f} MiB", file=sys.stderr, flush=True)
            run = run_in_cgroup([*run_argv, "--json", str(out)], limit, evict=evict, capture=True)
            runs.append((name, run, limit))
            rows += _rows_of(name, run, limit, out)
    return rows, {"lossless": lossless(rows), "tables": tables(rows, runs)}


def _rows_of(name: str, run, limit: int, out: Path) -> list[dict]:
    """The rows a run wrote (those it finished, if it failed), with the cgroup's figures."""
    rows = json.loads(out.read_text()) if out.exists() else []
    if run.returncode != 0:
        why = "killed by the cgroup's OOM killer" if run.oom_killed else f"exit code {run.returncode}"
        tail = (run.stderr or "").strip().splitlines()[-3:]
        print(
            f"cgroup bench: {name} failed under the limit ({why}); {len(rows)} rows kept\n  " + "\n  ".join(tail),
            file=sys.stderr,
            flush=True,
        )
    for r in rows:
        r.update(
            run=name, memory_budget_bytes=limit, peak_memory_bytes=run.peak_bytes, peak_held_bytes=run.peak_held_bytes
        )
        print(
            f"  {r['id']:<14} {label(r):<9} {len(r['new_token_ids']):>4} tokens {r['tokens_per_s']:>7.2f} tok/s",
            file=sys.stderr,
            flush=True,
        )
    return rows
