"""What a batch of generations costs the verifier: G trees verified in one forward (models/batch.py) against the
same G trees verified one after another, resident, on this machine's CPU kernels (issue 42).

    python -m bench.batch_verify [--target qwen2.5-coder-1.5b] [--nodes 16] [--batches 1,2,4,8]

Each generation has its own 64-token prompt and a 16-node tree of random tokens (the verdicts do not matter
here, the rows do); each figure is the best of three. Under a memory budget a forward also reads every streamed
layer once, whatever the number of rows: verified one after another, G trees read it G times.
"""

from __future__ import annotations

import argparse
import time

import torch

from common.settings import SamplingConfig
from formats import loading
from formats.convert import ensure_store
from speculative.tree import TokenTree
from speculative.verify import Verifier, verify_many


def _tree(g: torch.Generator, nodes: int, vocab: int, root: int) -> TokenTree:
    parents = [-1] + [int(torch.randint(-1, i, (1,), generator=g)) for i in range(1, nodes)]
    tokens = torch.randint(3, vocab, (nodes,), generator=g).tolist()
    tree = type("T", (), {"root": root, "tokens": tokens, "parents": parents, "probs": [0.5] * nodes})()
    return TokenTree.of(tree)


def _fresh(model, prompts):
    out = []
    for p in prompts:
        v = Verifier(model, SamplingConfig())
        v.start(p, len(p) + 64)
        out.append(v)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--nodes", type=int, default=16)
    ap.add_argument("--batches", default="1,2,4,8")
    a = ap.parse_args()
    model = loading.load_store(ensure_store(a.target, "int4")).model
    vocab = model.args.vocab_size
    g = torch.Generator().manual_seed(0)
    print("| trees | one after another (ms) | in one forward (ms) | ratio | one forward / one tree |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    one = None
    for n in map(int, a.batches.split(",")):
        prompts = [torch.randint(3, vocab, (64,), generator=g).tolist() for _ in range(n)]
        trees = [_tree(g, a.nodes, vocab, p[-1]) for p in prompts]
        solo = batch = float("inf")
        for _ in range(3):
            vs = _fresh(model, prompts)
            t = time.perf_counter()
            for v, tree in zip(vs, trees):
                v.verify_tree(tree)
            solo = min(solo, time.perf_counter() - t)
            vs = _fresh(model, prompts)
            t = time.perf_counter()
            verify_many(list(zip(vs, trees)))
            batch = min(batch, time.perf_counter() - t)
        one = one or solo
        print(f"| {n} | {solo * 1e3:.0f} | {batch * 1e3:.0f} | {solo / batch:.2f}x | {batch / one:.2f} |", flush=True)


if __name__ == "__main__":
    main()
