"""What the draft's trees cost a batch: N generations' trees of width W grown in shared draft forwards
(speculative/drafter.py `LocalDraft.propose_many`, what the draft actor's `cycle` runs for a batch), in this process, on this
machine's CPU kernels (issue 42: at eight slots under a budget the trees are a quarter of a cycle, BENCHMARKS.md).

    python -m bench.draft_trees [--draft qwen2.5-coder-0.5b] [--prompts FILE] [--slots 1,4,8] [--widths 8,16]

Each generation drafts from its own prompt of the set; after each cycle a verdict accepts its tree's likeliest
path, four tokens at most, and the draft's own next token, as a target that agrees with the draft that far would.
Reported per (slots, width): the median milliseconds a cycle's trees take and the median draft forwards they ran
(the deepest tree's), over the cycles after the first two (the prompts' own forwards).
"""

from __future__ import annotations

import argparse
import statistics
import time

ACCEPTED = 4  # draft tokens a verdict accepts at most (about what a tree of 8-16 gets under greedy decoding)


def verdict(p) -> tuple[list[int], list[int]]:
    """The likeliest path of the tree `p` proposed, at most ACCEPTED nodes, and the tokens it commits: the path's and
    the draft's own next token after it (where the draft ran on the path's end; else its first candidate's)."""
    from speculative.tree import ROOT

    t, path, node = p.draft.tree, [], ROOT
    while len(path) < ACCEPTED and t.children(node):
        node = max(t.children(node), key=lambda k: t.nodes[k].cum)
        path.append(node)
    new = [t.nodes[k].token for k in path]
    dist = p.draft.dists.get(path[-1]) if path else None
    new.append(int(dist.argmax()) if dist is not None else t.root_token)
    return path, new


def measure(model, prompts: list[list[int]], width: int, cycles: int) -> tuple[float, float]:
    """Median seconds of a cycle's trees and median draft forwards, `len(prompts)` generations at `width`."""
    from common.settings import SamplingConfig, TreeConfig
    from speculative.drafter import LocalDraft

    cfg = TreeConfig(width=width)
    drafts = []
    for ids in prompts:
        d = LocalDraft(model)
        d.start(ids[:-1], len(ids) + cycles * (ACCEPTED + 1) + 4 * width, ids[-1], cfg, SamplingConfig())
        drafts.append(d)
    seconds, forwards = [], []
    for _ in range(cycles):
        t0 = time.perf_counter()
        ps = LocalDraft.propose_many([(d, width, 0) for d in drafts])
        seconds.append(time.perf_counter() - t0)
        forwards.append(max((p.draft.forwards for p in ps if p is not None), default=0))
        for d, p, ids in zip(drafts, ps, prompts):
            if p is None:  # no tree: a plain step's verdict
                d.advance(None, [], [ids[-1]])
            else:
                d.advance(p, *verdict(p))
    keep = slice(2, None) if cycles > 3 else slice(None)
    return statistics.median(seconds[keep]), statistics.median(forwards[keep])


def main() -> None:
    import torch

    from engine.prompts import load_prompts
    from formats import loading
    from formats.convert import ensure_store

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b", help="a model name, file or weight store")
    ap.add_argument("--format", default="int4")
    ap.add_argument("--prompts", default="engine/assets/heldout.jsonl", help="a JSONL prompt set")
    ap.add_argument("--slots", default="1,4,8")
    ap.add_argument("--widths", default="8,16")
    ap.add_argument("--cycles", type=int, default=12)
    ap.add_argument("--threads", type=int, default=None, help="default: torch's (the cores)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    loaded = loading.load_store(ensure_store(a.draft, a.format))
    texts = [p.text for p in load_prompts(a.prompts)]
    slots = [int(x) for x in a.slots.split(",")]
    ids = [loaded.tokenizer.encode(t) for t in texts]
    ids = (ids * (1 + max(slots) // len(ids)))[: max(slots)]
    print(f"draft {a.draft} {a.format}, {torch.get_num_threads()} threads, {a.cycles} cycles each")
    print("| slots | width | trees a cycle (ms) | draft forwards | ms a forward |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for n in slots:
        for w in map(int, a.widths.split(",")):
            s, f = measure(loaded.model, ids[:n], w, a.cycles)
            print(f"| {n} | {w} | {s * 1e3:.0f} | {f:g} | {s * 1e3 / max(f, 1):.1f} |", flush=True)


if __name__ == "__main__":
    main()
