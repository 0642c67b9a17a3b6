"""One verification pass of a model by width, for each CPU kernel path side by side, runs interleaved.

Each arm is a process of its own holding the model (a kernel path is chosen once per process:
CADENCE_KERNEL_PATH), optionally from another checkout (`--old-checkout`: the kernels of another
version, with its own CADENCE_HOME for its own weight store); the driver asks the arms in turn for
one pass at a time, so a busy moment of the machine falls on every arm alike. Also measured: the
machine's memory read rate (torch's sum over 1 GiB, all threads) and, at width 1, the rate at
which a pass reads the weights.

    python -m bench.kernel_paths --model qwen2.5-coder-1.5b --fmt int4 \\
        --old-checkout /tmp/cadence-main --old-home /work/home-old
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

# The arm's side, as a script: it runs against either checkout, so it uses only what both have.
WORKER = r"""
import sys, time, torch
from formats import loading
from models.attention import Visibility
model_name, fmt, context = sys.argv[1], sys.argv[2], int(sys.argv[3])
lm = loading.load(model_name, fmt)
m = lm.model
cache = m.new_cache(context + 65)
m.forward(torch.arange(context) % 1000 + 100, torch.arange(context), cache)
cache.commit()
try:
    from models import kernels
    path = kernels.active_path()
except Exception:
    path = "main"
weights = sum(g.nbytes for n, g in lm.store.groups.items() if n != "embed")
print(f"ready {path} {weights}", flush=True)
for line in sys.stdin:
    w = int(line)
    toks, pos = torch.arange(w) % 1000 + 200, torch.arange(context, context + w)
    vis = Visibility.tree(context, [i - 1 for i in range(w)])
    for _ in range(2):  # the second pass is timed: threads awake, as in a run of passes
        t = time.perf_counter()
        m.forward(toks, pos, cache, vis)
        dt = time.perf_counter() - t
        cache.rewind(context)
    print(dt, flush=True)
"""


QUIET_S = 0.3  # before each request: the threads of the process that ran last stop spinning (they share the cores)


class Arm:
    def __init__(self, label: str, model: str, fmt: str, context: int, env: dict, cwd: str | None = None):
        self.label = label
        # cwd: `python -c` puts the working directory first on the import path
        self.proc = subprocess.Popen(
            [sys.executable, "-c", WORKER, model, fmt, str(context)],
            env=env,
            cwd=cwd,
            text=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        ready = self.proc.stdout.readline().split()
        if not ready or ready[0] != "ready":
            raise SystemExit(f"arm {label} did not start")
        self.path, self.weight_bytes = ready[1], int(ready[2])

    def time(self, width: int) -> float:
        time.sleep(QUIET_S)
        self.proc.stdin.write(f"{width}\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


_ONES = None


def memory_read_rate(threads: int) -> float:
    """GB/s of a plain streaming read: torch's sum over 1 GiB of floats, the best of 4."""
    import torch

    global _ONES
    torch.set_num_threads(threads)
    if _ONES is None:
        _ONES = torch.ones(1 << 28)
    best = float("inf")
    for _ in range(4):
        t = time.perf_counter()
        _ONES.sum()
        best = min(best, time.perf_counter() - t)
    return _ONES.numel() * 4 / best / 1e9


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--fmt", default="int4")
    ap.add_argument("--paths", default="", help="kernel paths to compare (default: every path this CPU has)")
    ap.add_argument("--widths", default="1,4,16,64")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--old-checkout", help="another checkout whose kernels run as one more arm")
    ap.add_argument("--old-home", help="CADENCE_HOME for the old checkout (its own weight store)")
    ap.add_argument("--samples", action="store_true", help="print every timing, not only the medians")
    args = ap.parse_args(argv)
    from models import kernels

    paths = [p for p in args.paths.split(",") if p] or kernels.host_paths()
    widths = [int(w) for w in args.widths.split(",")]
    threads = os.cpu_count() or 1
    print(f"machine: {kernels.cpu_model()}, {threads} threads")
    base = dict(os.environ)
    arms = []
    if args.old_checkout:
        env = dict(base, PYTHONPATH=args.old_checkout, CADENCE_HOME=args.old_home or base.get("CADENCE_HOME", ""))
        arms.append(Arm("old", args.model, args.fmt, args.context, env, cwd=args.old_checkout))
    for p in paths:
        arms.append(Arm(p, args.model, args.fmt, args.context, dict(base, CADENCE_KERNEL_PATH=p)))
    times = {(a.label, w): [] for a in arms for w in widths}
    try:
        for w in widths:
            for a in arms:
                a.time(w)  # warm
        rates = []
        for r in range(args.reps):
            time.sleep(QUIET_S)
            rates.append(memory_read_rate(threads))  # the machine's rate drifts (a shared host): taken each round
            for w in widths:
                for a in arms[r % len(arms) :] + arms[: r % len(arms)]:
                    times[a.label, w].append(a.time(w))
    finally:
        for a in arms:
            a.close()
    if args.samples:
        for (label, w), v in times.items():
            print(label, w, " ".join(f"{x * 1e3:.1f}" for x in v))
    rate = statistics.median(rates)
    print(
        f"memory read rate (torch's sum over 1 GiB, median of {len(rates)} rounds): {rate:.1f} GB/s "
        f"(rounds: {', '.join(f'{x:.0f}' for x in rates)})"
    )
    _report(arms, widths, times, rate)
    return 0


def _report(arms, widths, times, rate):
    med = {k: statistics.median(v) for k, v in times.items()}
    head = [
        "arm (path)",
        *[f"width {w} (ms)" for w in widths],
        *[f"{w} / 1" for w in widths[1:]],
        "GB/s at width 1",
        "/ memory rate",
    ]
    print("| " + " | ".join(head) + " |")
    print("| " + " | ".join(["---"] + ["---:"] * (len(head) - 1)) + " |")
    for a in arms:
        one = med[a.label, widths[0]]
        cells = [
            f"{a.label} ({a.path})",
            *[f"{med[a.label, w] * 1e3:.1f}" for w in widths],
            *[f"{med[a.label, w] / one:.2f}x" for w in widths[1:]],
            f"{a.weight_bytes / one / 1e9:.1f}",
            f"{a.weight_bytes / one / 1e9 / rate:.0%}",
        ]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    raise SystemExit(main())
