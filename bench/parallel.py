"""Many requests at once (issue 42): the same prompts run one at a time (today's server: a request waits for the one
before it) and `--parallel N` together, each in a memory cgroup of the budget where one is given. Reports the
aggregate tokens/s and its ratio to one at a time, each request's time to its first token and its own tokens/s, the
cgroup's peak, and whether every generation equals the one-at-a-time run token for token.

    python -m bench.parallel --prompts engine/assets/heldout.jsonl --limit 8 --max-new-tokens 64 \\
        --parallel 1,2,4,8 --memory-budget 768MiB

`--mode tree,target --rounds 3`: plain batched decoding beside the trees, every configuration three times,
interleaved, each row its median run, and the ratio of the two modes at each N. With `--rounds`, each round's
ratio to its own round's one-at-a-time run too (a noisy disk's slow minutes fall on both), and whether every run
is lossless.

"while N run": the aggregate over the cycles in which N generations ran, all slots busy (`while_full`): a finite
set's drain at the end, where the queue is empty and fewer run, is left out of it (the whole-run figure keeps it).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common.errors import Terminated, stop_on_sigterm
from common.units import parse_bytes


def child(args) -> None:
    """One configuration in this process: every prompt's generation, its first-token and end times."""
    from engine.config import RunConfig
    from engine.prompts import load_prompts
    from engine.runner import Runner

    prompts = load_prompts(args.prompts)[: args.limit]
    opts = dict(parallel=args.n or 1, max_new_tokens=args.max_new_tokens, no_trace=True, mode=args.mode)
    if args.memory_budget:
        opts["memory_budget"] = args.memory_budget
    with Runner(RunConfig.from_options(**opts), prompts, say=lambda line: None) as r:  # as `launch run` runs them
        first, ends, rows = {}, {}, {}
        t0 = time.perf_counter()
        chunks = []  # (seconds, prompt, tokens) of every chunk, as it came
        it = ((p, c) for p in prompts for c in r.stream(p)) if args.n == 0 else r.stream_many(prompts)
        for p, c in it:  # n 0: one at a time, as a server without slots serves them
            now = time.perf_counter() - t0
            first.setdefault(p.id, now)
            if isinstance(c, Exception):
                continue
            chunks.append((now, p.id, len(c.tokens)))
            if c.completion is not None:
                ends[p.id], rows[p.id] = now, c.completion.row
        wall = time.perf_counter() - t0
    out = {
        "wall_s": wall,
        "tokens": sum(len(row["new_token_ids"]) for row in rows.values()),
        "ids": {k: row["new_token_ids"] for k, row in rows.items()},
        "prompt_ids": {k: row["prompt_token_ids"] for k, row in rows.items()},
        "ttft_s": first,
        "end_s": ends,
        "tokens_per_s": {k: row["tokens_per_s"] for k, row in rows.items()},
        "width": r.plan.tree.width,
        "cycles": cycles(chunks),
    }
    Path(args.out).write_text(json.dumps(out))


CYCLE_GAP = 0.02  # seconds between two chunks that come from different cycles (a cycle's come together)


def cycles(chunks: list[tuple[float, str, int]]) -> list[tuple[float, int, int]]:
    """(seconds, generations, tokens) of each cycle of a run, from its chunks as they came: a cycle's chunks come
    in one burst when it ends (one a generation it moved), its seconds run from the last cycle's end."""
    out, last, start = [], 0.0, 0
    for i in range(1, len(chunks) + 1):
        if i == len(chunks) or chunks[i][0] - chunks[i - 1][0] > CYCLE_GAP:
            burst = chunks[start:i]
            out.append((burst[-1][0] - last, len({c[1] for c in burst}), sum(c[2] for c in burst)))
            last, start = burst[-1][0], i
    return out


def while_full(r: dict, n: int) -> float | None:
    """Aggregate tok/s over the cycles in which `n` generations ran (the slots all busy: the drain at the end,
    where the queue is empty and fewer run, left out); one at a time (n 1): every cycle of every generation."""
    full = [(s, t) for s, k, t in r.get("cycles", ()) if k >= n]
    secs = sum(s for s, _ in full)
    return sum(t for _, t in full) / secs if secs > 0 else None


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.parallel")
    ap.add_argument("--prompts", default="engine/assets/heldout.jsonl")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--parallel", default="1,2,4,8", help="the N to run together (one at a time always runs first)")
    ap.add_argument("--memory-budget", default=None, help="run each in a memory cgroup of this size")
    ap.add_argument(
        "--mode", default="tree", help="tree, or target: plain batched decoding, no draft; or both: tree,target"
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="every configuration this many times, interleaved; each row its median run",
    )
    ap.add_argument("--llama-server", help="a llama-server binary: run it with -np N on the same prompts' ids too")
    ap.add_argument("--gguf", help="the GGUF llama-server runs (default: the pulled default target's)")
    ap.add_argument(
        "--llama-limit", type=int, help="llama-server gets only this many of the prompts (it is slow under a budget)"
    )
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--llama-ids", help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child and args.llama_server:
        from bench import llama_server

        ids = json.loads(Path(args.llama_ids).read_text())
        result = llama_server.child(args.llama_server, args.gguf, ids, args.n, args.max_new_tokens)
        return llama_server.write(args.out, result)
    if args.child:
        return child(args)
    ns = [0, *(int(x) for x in args.parallel.split(","))]
    modes = args.mode.split(",")
    common = ["--max-new-tokens", str(args.max_new_tokens)]
    runs: dict = {(m, n): [] for m in modes for n in ns}
    if args.memory_budget:
        _prepare(args)
    for _ in range(args.rounds):  # interleaved: a noisy host's slow minutes fall on every configuration alike
        for n in ns:
            for m in modes[: 1 if n == 0 else None]:  # one at a time: the first mode's (today's server)
                cfg = ["--n", str(n), "--prompts", args.prompts, "--limit", str(args.limit), "--mode", m, *common]
                runs[(m, n)].append(_run(args, cfg))
    base = _median(runs[(modes[0], 0)])
    tables = {m: {0: base, **{n: _median(runs[(m, n)]) for n in ns if n}} for m in modes}
    median = f"; each row the median of {args.rounds} runs" if args.rounds > 1 else ""
    for m in modes:
        _table(tables[m], f"cadence --mode {m} (one at a time: --mode {modes[0]}'s{median})")
    if args.rounds > 1:
        _by_round(runs, modes, ns, base)
    if len(modes) > 1:
        print(f"\n{modes[0]} / {modes[1]} at the same N (aggregate tok/s):")
        for n in ns[1:]:
            a, b = tables[modes[0]][n], tables[modes[1]][n]
            if a and b:
                print(f"  N={n}: {_agg(a):.2f} / {_agg(b):.2f} = {_agg(a) / _agg(b):.2f}")
    if args.llama_server and base:
        from pulls.wheels import model_path
        from pulls.registry import DEFAULT_TARGET, spec

        gguf = args.gguf or str(model_path(spec(DEFAULT_TARGET)))
        ids = dict(list(base["prompt_ids"].items())[: args.llama_limit])
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(ids, f)
        llama = ["--llama-server", args.llama_server, "--gguf", gguf, "--llama-ids", f.name, *common]
        _table({n: _run(args, ["--n", str(n), *llama], evict=[gguf]) for n in ns}, f"llama-server -np N ({gguf})")
        os.unlink(f.name)


def _prepare(args) -> None:
    """The weight stores and this machine's costs the runs read, made here, outside the cgroups: a first run's
    conversion holds the unquantized weights, more than a small budget, and would be killed inside one."""
    from engine.config import RunConfig
    from engine.budget_choice import prepare_drafts
    from engine.inputs import tree_pair
    from engine.machine import ThisMachine
    from engine.prompts import load_prompts

    cfg = RunConfig.from_options(memory_budget=args.memory_budget, max_new_tokens=args.max_new_tokens)
    machine = ThisMachine(lambda line: print(line, file=sys.stderr, flush=True))
    tree_pair(cfg, machine, load_prompts(args.prompts)[: args.limit])
    prepare_drafts(cfg.with_mode("tree"), machine)


def _run(args, argv: list[str], evict=()) -> dict | None:
    """One configuration in a child process (in a memory cgroup of the budget where one is given): its figures."""
    from bench.cgroup import run_in_cgroup
    import subprocess

    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    argv_ = [sys.executable, "-m", "bench.parallel", "--child", "--out", out, *argv]
    peak = None
    if args.memory_budget:
        argv_ += ["--memory-budget", args.memory_budget]
        run = run_in_cgroup(argv_, parse_bytes(args.memory_budget), evict=evict, timeout=3600)
        ok, peak, err = run.returncode == 0 and not run.oom_killed, run.peak_held_bytes or run.peak_bytes, run.stderr
    else:
        p = subprocess.run(argv_, capture_output=True, text=True, timeout=3600)
        ok, err = p.returncode == 0, p.stderr
    if not ok:
        print(f"{' '.join(argv)} failed: {err[-800:]}", file=sys.stderr)
        return None
    r = json.loads(Path(out).read_text())
    r["peak"] = peak
    os.unlink(out)
    return r


def _agg(r: dict) -> float:
    return r["tokens"] / r["wall_s"]


def _by_round(runs: dict, modes: list[str], ns: list[int], base: dict | None) -> None:
    """Each round's ratio to that round's one at a time (the same minutes of a noisy disk on both), their median,
    and whether every run (not only each row's median one) equals one at a time token for token."""
    alone = runs[(modes[0], 0)]
    print("\nx one at a time, round by round (each against its own round's one at a time):")
    for m in modes:
        for n in ns[1:]:
            got = [(r, a) for r, a in zip(runs[(m, n)], alone) if r is not None and a is not None]
            if not got:
                continue
            ratios = [_agg(r) / _agg(a) for r, a in got]
            busy = [f / o for f, o in ((while_full(r, n), while_full(a, 1)) for r, a in got) if f and o]
            same = all(r["ids"] == base["ids"] for r, _ in got) if base else False
            print(
                f"  --mode {m} N={n}: {', '.join(f'{x:.2f}x' for x in ratios)}; median {statistics.median(ratios):.2f}x; "
                f"while {n} run: {', '.join(f'{x:.2f}x' for x in busy)}"
                f"{f'; median {statistics.median(busy):.2f}x' if busy else ''}; "
                f"every run lossless: {'yes' if same else 'NO'}"
            )


def _median(runs: list) -> dict | None:
    """The run of the median aggregate tok/s (the lower of the two middle ones), None where none finished."""
    done = sorted((r for r in runs if r is not None), key=_agg)
    return done[(len(done) - 1) // 2] if done else None


def _table(results: dict, title: str) -> None:
    results = {n: r for n, r in results.items() if r is not None}
    base = results.get(0)
    print(f"\n{title}\n")
    print(
        "| N | how | width | aggregate tok/s | x one at a time | while N run: tok/s | x | mean TTFT s "
        "| mean tok/s each | peak held MiB | lossless |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for n, r in results.items():
        agg = r["tokens"] / r["wall_s"]
        ratio = agg / (base["tokens"] / base["wall_s"]) if base else float("nan")
        full, one = while_full(r, n or 1), while_full(base, 1) if base else None
        busy = f"{full:.2f} | {full / one:.2f}x" if full and one else "- | -"
        same = base is not None and r["ids"] == base["ids"]
        peak = f"{r['peak'] / 2**20:.0f}" if r["peak"] else "-"
        how = "one at a time" if n == 0 else f"--parallel {n}"
        print(
            f"| {n or 1} | {how} | {r['width']} | {agg:.2f} | {ratio:.2f}x | {busy} "
            f"| {statistics.mean(r['ttft_s'].values()):.2f} | {statistics.mean(r['tokens_per_s'].values()):.2f} "
            f"| {peak} | {'yes' if same else 'NO'} |"
        )


if __name__ == "__main__":
    stop_on_sigterm()  # as Ctrl-C: the run in its cgroup is killed and the cgroup removed
    try:
        main()
    except KeyboardInterrupt as e:
        why = "stopped by SIGTERM" if isinstance(e, Terminated) else "interrupted"
        print(f"bench.parallel: {why}; the run under way was stopped and nothing is reported", file=sys.stderr)
        sys.exit(128 + (e.signum if isinstance(e, Terminated) else signal.SIGINT))
