"""A mixture of experts' routing replayed through expert buffers of several sizes: each buffer policy's
hit rate on one recorded trace, free of the machine's noise (`simulate`, scheduler/generation/expert_policy.py).

The trace is what the runtime sees: greedy decoding of the prompts by the resident model, every
token's experts at every layer, and for the lookahead, the experts layer i+1's router picks for
layer i's input (mixtral-offloading's guess), the likeliest first. EdgeMoE's eviction takes its
frequencies, and its preloading its path statistics, from the profile `launch models profile-experts`
wrote from calibration prompts (not these).

    python -m bench.expert_replay --target MODEL --prompts P.jsonl --tokens 32 --capacities 64,128,256
"""

from __future__ import annotations

import argparse
import json
import sys

from scheduler.generation.expert_policy import PATHS_FILE
from scheduler.generation.expert_policy import LRU, EdgeMoEEviction, PathStats, simulate


def record(model, prompts: list[list[int]], n_new: int) -> tuple[list, list]:
    """(trace[token][layer] = its experts, lookahead[token][layer] = the guessed experts of that layer, the
    likeliest first; none at layer 0), over greedy decoding of each prompt."""
    from models import moe
    from models.routing import routed_forwards

    trace, guesses = [], []
    n = model.args.n_layers
    for ids in prompts:
        for routes in routed_forwards(model, ids, n_new):
            for r in range(len(routes[0][0])):
                trace.append([routes[i][0][r].tolist() for i in range(n)])
                guesses.append([[]] + [list(moe.guess(model, i, routes[i][2][r : r + 1])) for i in range(n - 1)])
    return trace, guesses


def replay(
    trace, guesses, profile: PathStats, n_layers: int, n_experts: int, capacities: list[int], k: int
) -> list[list[str]]:
    rows = [
        ["buffer (experts)", "lru", "edgemoe", "lru + paths", "edgemoe + paths", "lru + router", "edgemoe + router"]
    ]
    ahead = [[g[:k] for g in per] for per in guesses]
    for c in capacities:
        runs = [
            simulate(trace, c, LRU()),
            simulate(trace, c, EdgeMoEEviction(n_layers, n_experts, profile.frequency())),
            simulate(trace, c, LRU(), preload=profile, preload_k=k),
            simulate(trace, c, EdgeMoEEviction(n_layers, n_experts, profile.frequency()), preload=profile, preload_k=k),
            simulate(trace, c, LRU(), lookahead=ahead),
            simulate(trace, c, EdgeMoEEviction(n_layers, n_experts, profile.frequency()), lookahead=ahead),
        ]
        rows.append([str(c), *[f"{r.hit_rate:.3f} ({(r.misses + r.preloaded) / len(trace):.1f})" for r in runs]])
    return rows


def main(argv=None) -> int:
    from engine.prompts import load_prompts
    from formats import loading
    from formats.convert import ensure_store

    p = argparse.ArgumentParser(prog="python -m bench.expert_replay")
    p.add_argument("--target", required=True)
    p.add_argument("--dtype", dest="fmt", default="int4")
    p.add_argument("--prompts", required=True)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--capacities", default="64,128,256,512")
    p.add_argument("--preload-k", type=int, default=2)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    st = ensure_store(a.target, a.fmt)
    lm = loading.load_store(st)
    profile = PathStats.load(st.dir / PATHS_FILE)
    ids = [lm.tokenizer.encode(q.text) for q in load_prompts(a.prompts)]
    trace, guesses = record(lm.model, ids, a.tokens)
    table = replay(
        trace,
        guesses,
        profile,
        st.args.n_layers,
        st.args.n_experts,
        [int(c) for c in a.capacities.split(",")],
        a.preload_k,
    )
    print(
        f"{len(trace)} tokens, {st.args.n_layers} layers x {st.args.n_experts} experts, top-{st.args.n_experts_used}; "
        "hit rate (expert reads per token)"
    )
    for row in table:
        print("| " + " | ".join(row) + " |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"tokens": len(trace), "table": table}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
