"""What the live monitor costs the run (BENCHMARKS.md, "Monitor overhead").

    .venv/bin/python -m bench.monitor [--pairs 20] [--tokens 80] [--cpu-s 1.5] [--json OUT]

from the repository root (its generation arm drives the fake actors that live beside the tests).

The machine this runs on is shared and noisy, so the two arms are interleaved in short blocks
(off/on, then on/off, ...) and compared pair by pair, which cancels slow drifts in background load:

- generation: the scheduler `launch run` uses (`ActorSession`, streamed tree mode with the
  worker) over the four fake actors (tests/runtime/fakes/actors.py: seeded sleeps, real arena traffic, tracing
  on); each block is one `generate` of `tokens` tokens, with or without
  `Monitor(MonitorFeed(sched))` drawing at 4 Hz into a terminal console (written to /dev/null);
- cpu: a compute-bound loop in this process (torch matmuls on every core plus a little Python
  per step, as in-process generation is) for `cpu_s` seconds a block, with or without
  `Monitor(MonitorFeed(None))`, which also samples this process's memory once a second;
- frame: what one frame costs (snapshot + render + write), timed alone.

A monitor is started 0.3 s before its block's clock starts (in a run it starts while the
models load; the other arm pauses as long), and stopped inside the block (one extra frame), so
the figure errs high.
Each monitor block also reports the CPU time of the monitor's own threads (Live's refresh
thread; the feed's memory sampler in-process) from their CPU-time clocks, a figure that
background load hardly moves. Each
block measures the CPU that other processes took meanwhile (all busy time, steal included, less
this process and its actors); a pair where either block saw more than 20% of a core of that is
"contaminated", and the ratios are reported over the clean pairs too.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from contextlib import contextmanager

import psutil
from rich.console import Console

from observe.monitor import Monitor
from observe.feed import MonitorFeed


WARM_S = 0.3  # the monitor runs this long before a block's clock starts


def _console() -> Console:
    return Console(file=open(os.devnull, "w"), force_terminal=True, width=120)


def _monitor_threads(mon: Monitor, feed: MonitorFeed) -> list:
    """The threads the monitor added: Rich's refresh thread (private API: best effort) and, in
    process, the feed's memory sampler."""
    return [t for t in (*mon.threads(), *feed.threads()) if t.ident is not None]


def _thread_cpu_s(threads: list) -> float:
    """CPU seconds the live `threads` have used (their CPU-time clocks, ns resolution)."""
    total = 0.0
    for t in threads:
        try:
            total += time.clock_gettime(time.pthread_getcpuclockid(t.ident))
        except (OSError, ProcessLookupError):
            pass
    return total


def _busy_s() -> float:
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


def _own_s() -> float:
    procs = [psutil.Process()]
    procs += procs[0].children(recursive=True)
    total = 0.0
    for p in procs:
        try:
            c = p.cpu_times()
            total += c.user + c.system
        except psutil.Error:
            pass
    return total


def _pairs(n: int, block) -> dict:
    """`block(monitor: bool, seed) -> dict` n times each way, alternating which goes first; each block
    also gets `foreign`: the cores other processes kept busy meanwhile."""
    out = {"off": [], "on": []}
    for i in range(n):
        for on in (False, True) if i % 2 == 0 else (True, False):
            busy, own, t0 = _busy_s(), _own_s(), time.perf_counter()
            b = block(on, i)
            b["foreign"] = max(0.0, (_busy_s() - busy) - (_own_s() - own)) / (time.perf_counter() - t0)
            out["on" if on else "off"].append(b)
    return out


def _ratios(pairs: list, key: str) -> dict:
    ratios = [on[key] / off[key] for on, off in pairs]
    if not ratios:
        return {"n": 0}
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return {"n": len(ratios), "median": statistics.median(ratios), "q1": q[0], "q3": q[2]}


def _summary(arms: dict, key: str, clean_below: float = 0.2) -> dict:
    pairs = list(zip(arms["on"], arms["off"]))
    total = {arm: sum(b["n"] for b in arms[arm]) / sum(b["s"] for b in arms[arm]) for arm in arms}
    cpu = sum(b["monitor_cpu_s"] for b in arms["on"]) / sum(b["s"] for b in arms["on"])
    clean = [(on, off) for on, off in pairs if on["foreign"] < clean_below and off["foreign"] < clean_below]
    r = _ratios(pairs, key)
    return {
        "median_ratio": r["median"],
        "q1": r["q1"],
        "q3": r["q3"],
        "clean": _ratios(clean, key),
        "total_ratio": total["on"] / total["off"],
        "off_rate": total["off"],
        "on_rate": total["on"],
        "monitor_cpu_frac": cpu,
    }


# seeded sleeps of the fakes, per group of a forward, load, tree, split layer (tests/runtime/fakes/actors.py)
FAKE_SCRIPT = {
    "verifier": {"durations": {"group": [0.001, 0.002]}},
    "loader": {"durations": {"load": [0.002, 0.004]}},
    "draft": {"durations": {"build": [0.002, 0.004]}},
    "sparse": {"durations": {"attend": [0.001, 0.002]}},
}


def bench_generation(pairs: int, tokens: int, seed: int = 0) -> dict:
    from tests.runtime.fakes.actors import FAKES, fake_args, target_text, write_fake_store
    from common.settings import SamplingConfig, TreeConfig, WorkerSplit
    from scheduler.runtime_config import KiB
    from scheduler.generation.memplan import Overheads, plan_memory
    from scheduler.generation.session import ActorSession, SessionSpec
    from scheduler.runtime import Runtime

    groups = {**{f"layer.{i}": 64 * KiB for i in range(8)}, "head.0": 64 * KiB}
    o = Overheads(
        scheduler=0,
        watchdog=0,
        runtime=0,
        actor=0,
        exchange=64 * KiB,
        verifier_activations=0,
        draft_activations=0,
        code=0,
    )
    plan = plan_memory(o.exchange + 3 * 64 * KiB + 3 * 64 * KiB, groups, 0, 0, 0, o)  # 4 resident, 5 streamed
    prompt = target_text([1, 2], 40, 64)
    with tempfile.TemporaryDirectory() as traces, tempfile.TemporaryDirectory() as model:
        store = write_fake_store(model, groups, 64, seed, **FAKE_SCRIPT)
        with Runtime(_fake_config(plan, traces)) as sched:
            # a fixed budget and no trie: both blocks of a pair replay one workload
            tree = TreeConfig(width=6, adaptive=False, trie=False)
            spec = ActorSession(
                sched,
                SessionSpec(
                    "tree",
                    store,
                    fake_args(),
                    store,
                    SamplingConfig(),
                    tree,
                    1,
                    4096,
                    plan=plan,
                    worker=WorkerSplit(0.3, 0.2),
                ),
                impl=FAKES,
            )
            try:
                block = lambda on, seed: _generation_block(sched, spec, prompt, tokens, on, seed)  # noqa: E731
                block(True, -1)  # warm up
                arms = _pairs(pairs, block)
            finally:
                spec.close()
    return {"tokens": tokens, "pairs": pairs, **_summary(arms, "rate"), "blocks": arms}


def _fake_config(plan, traces: str):
    from scheduler.runtime_config import GiB, MiB, MemoryConfig, PipelineConfig, RuntimeConfig, TraceConfig

    return RuntimeConfig(
        memory=MemoryConfig(
            budget_bytes=4 * GiB, arena_bytes=plan.stream_bytes + 2 * MiB, stream_bytes=plan.stream_bytes, sample_s=0.5
        ),
        pipeline=PipelineConfig(layer_bytes=plan.slot_bytes),
        trace=TraceConfig(dir=traces, max_events=10_000_000),
    )


def _generation_block(sched, spec, prompt: list[int], tokens: int, on: bool, seed: int) -> dict:
    """One block of a pair: the fakes reseeded, a generation with the monitor on or off."""
    from tests.runtime.fakes.actors import FAKES

    for role in FAKES:
        sched.call(role, "reseed", {"seed": seed})
    with _monitored(on, lambda: MonitorFeed(sched)) as out:
        feed = out["feed"]
        on_cycle = (lambda st: feed.on_tokens(len(st.tokens), st.accepted, st.alpha)) if feed else None
        out["n"] = len(spec.loop.generate(prompt, tokens, set(), on_cycle=on_cycle).new_ids)
    return {**out, "rate": out["n"] / out["s"]}


@contextmanager
def _monitored(on: bool, feed_of):
    """A block with the monitor on (fed by `feed_of()`) or off, the clock started after the same pause in
    both: the dict it yields gets the seconds, the frames drawn and the monitor's CPU seconds."""
    feed = feed_of() if on else None
    mon = Monitor(feed, console=_console()) if on else None
    if mon:
        mon.start()
    time.sleep(WARM_S)
    out = {"feed": feed}
    t0 = time.perf_counter()
    cpu0 = _thread_cpu_s(_monitor_threads(mon, feed)) if mon else 0.0
    try:
        yield out
    finally:
        cpu = 0.0
        if mon:
            cpu = _thread_cpu_s(_monitor_threads(mon, feed)) - cpu0
            mon.stop()
        del out["feed"]
        out.update(s=time.perf_counter() - t0, frames=mon.frames if mon else 0, monitor_cpu_s=cpu)


def bench_cpu(pairs: int, seconds: float) -> dict:
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    b = torch.randn(384, 384)

    def block(on: bool, seed: int) -> dict:
        a = torch.randn(384, 384, generator=torch.Generator().manual_seed(seed))
        with _monitored(on, lambda: MonitorFeed(None, title="cpu bench")) as out:
            feed, steps, t0 = out["feed"], 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                for _ in range(4):
                    a = torch.tanh(a @ b) * 0.5  # the GIL is released inside
                steps += 1
                if feed:
                    feed.on_tokens(1)
                    feed.on_text(".")
            out["n"] = steps
        return {**out, "rate": out["n"] / out["s"]}

    block(True, -1)  # warm up
    arms = _pairs(pairs, block)
    return {"seconds": seconds, "pairs": pairs, **_summary(arms, "rate"), "blocks": arms}


def frame_cost(frames: int = 200) -> dict:
    """ms per frame for snapshot + render + write, from a feed with numbers in it."""
    feed = MonitorFeed(None, title="frame cost")
    for i in range(200):
        feed.on_tokens(3, accepted=i % 5, alpha=0.5 + 0.01 * (i % 7))
        feed.on_text(f"token{i} ")
    mon = Monitor(feed, console=_console())
    t0 = time.perf_counter()
    for _ in range(frames):
        mon.console.print(mon.frame())
    dt = time.perf_counter() - t0
    t1 = time.perf_counter()
    for _ in range(frames):
        feed.snapshot()
    snap = time.perf_counter() - t1
    feed.close()
    return {"frame_ms": 1000 * dt / frames, "snapshot_ms": 1000 * snap / frames}


def bench(pairs: int = 20, tokens: int = 80, cpu_s: float = 1.5) -> dict:
    out = {
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "python": platform.python_version(),
        },
        "frame": frame_cost(),
        "generation": bench_generation(pairs, tokens),
    }
    if cpu_s > 0:
        out["cpu"] = bench_cpu(pairs, cpu_s)
    return out


def format_result(r: dict) -> str:
    def row(what: str, x: dict, unit: str) -> str:
        c = x["clean"]
        clean = (
            f"; over the {c['n']} clean pairs {c['median']:.4f} (IQR {c['q1']:.4f}..{c['q3']:.4f}), slowdown "
            f"{100 * (1 - c['median']):+.2f}%"
            if c["n"]
            else "; no clean pair"
        )
        return (
            f"{what}: off {x['off_rate']:.1f} {unit}, on {x['on_rate']:.1f} {unit}; on/off: total "
            f"{x['total_ratio']:.4f}, median of {x['pairs']} pairs {x['median_ratio']:.4f} "
            f"(IQR {x['q1']:.4f}..{x['q3']:.4f}), slowdown {100 * (1 - x['median_ratio']):+.2f}%{clean}; "
            f"the monitor's threads used {100 * x['monitor_cpu_frac']:.2f}% of one core"
        )

    p, f = r["generation"], r["frame"]
    lines = [row(f"fake-actor generation ({p['tokens']} tokens a block)", p, "tok/s")]
    if "cpu" in r:
        lines.append(row(f"compute-bound loop in-process ({r['cpu']['seconds']:g} s a block)", r["cpu"], "steps/s"))
    lines.append(
        f"one frame: {f['frame_ms']:.2f} ms (snapshot {f['snapshot_ms']:.2f} ms); at 4 Hz "
        f"{0.4 * f['frame_ms']:.2f}% of one core"
    )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.monitor", description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=20, help="off/on pairs of blocks per workload")
    ap.add_argument("--tokens", type=int, default=80, help="tokens per fake-actor block")
    ap.add_argument("--cpu-s", type=float, default=1.5, help="seconds per compute-bound block (0: skip)")
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args(argv)
    r = bench(args.pairs, args.tokens, args.cpu_s)
    print(format_result(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
