"""Tree acceptance by growth policy, teacher-forced: the draft grows a tree at each position of the target's own
greedy continuation, and the tree's accepted length is the longest path that follows it.

    python -m bench.tree_growth [--drafts int2:16384,int4:32768] [--widths 8,16,32] [--tokens 48] [--limit 0]
                                [--feeds 2,4]

Every dev and held-out prompt; the target's continuations come from the 1.5B int4 in this process (the same
tokens every run gives: greedy). Each tree is built by the drafter as a run builds it (`Drafter.build_tree`,
the trie included), then advanced by the verdict the target would give, so a policy's figure is what it
accepts per verification in a run, free of the machine's timing. Prints a markdown table. `--feeds`: best-first
trees again with that many candidates a draft forward, in place of the drafter's own count (`bestfirst.feed`).
"""

from __future__ import annotations

import argparse

from bench.flash_quality import continuation
from common.settings import SamplingConfig, TreeConfig
from engine.config import RunConfig
from engine.prompts import load_prompts
from engine.inputs import read_inputs
from engine.machine import ThisMachine
from formats import loading
from formats.convert import ensure_store
from speculative import bestfirst
from speculative.drafter import Drafter
from speculative.sides import slack
from speculative.tree import ROOT

PROMPTS = ("engine/assets/heldout.jsonl", "engine/assets/dev.jsonl")


def accepted(
    model, prompts: list[list[int]], conts: list[list[int]], cfg: TreeConfig, before=None
) -> tuple[float, float]:
    """(draft tokens accepted, draft forwards) per verification over the prompts' continuations. `before(n, m)`,
    if given, is called before each tree of prompt n: the target has run its first m tokens (the prompt and the
    continuation up to the tree's root, exclusive)."""
    acc = verifications = forwards = 0
    for n, (ids, cont) in enumerate(zip(prompts, conts)):
        d = Drafter(model, SamplingConfig(), cfg)
        d.start(ids, len(ids) + len(cont) + slack(cfg))
        d.push(cont[:1])
        at = 1
        while at < len(cont):
            if before is not None:
                before(n, len(ids) + at - 1)
            tree = d.build_tree()
            t, node, path = tree.tree, ROOT, []
            while at + len(path) < len(cont):
                want = cont[at + len(path)]
                node = next((c for c in t.children(node) if t.nodes[c].token == want), None)
                if node is None:
                    break
                path.append(node)
            new = cont[at : at + len(path) + 1]
            d.advance(tree, path, new)
            d.update_threshold(tree, path)
            acc, verifications, forwards = acc + len(path), verifications + 1, forwards + tree.forwards
            at += len(new)
    return acc / verifications, forwards / verifications


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.tree_growth", description=__doc__.splitlines()[0])
    ap.add_argument("--drafts", default="int2:16384,int2:32768,int4:32768", help="FORMAT:HEAD_ROWS of the 0.5B draft")
    ap.add_argument("--widths", default="8,16,32")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--limit", type=int, default=0)
    ap.add_argument("--feeds", default="", help="best first with N candidates a draft forward (list)")
    a = ap.parse_args(argv)
    own = bestfirst.feed
    items = [p for f in PROMPTS for p in load_prompts(f)][: a.limit or None]
    r = read_inputs(RunConfig.from_options(mode="target", max_new_tokens=a.tokens), ThisMachine(), items)
    prompts = [r.prompt_ids(p)[0] for p in items]
    target = loading.load_store(r.target).model
    conts = [continuation(target, ids, a.tokens, set(r.tokenizer.stop_ids)) for ids in prompts]
    del target
    print(f"{len(prompts)} prompts x {a.tokens} tokens of the target's greedy continuation")
    print("| draft | width | growth | accepted / verification | draft forwards / verification |")
    print("| --- | ---: | --- | ---: | ---: |")
    runs = [("best", None), ("pacer", None)] + [("best", int(n)) for n in a.feeds.split(",") if n]
    try:
        for spec in a.drafts.split(","):
            fmt, rows = spec.split(":")
            draft = loading.load_store(ensure_store("qwen2.5-coder-0.5b", fmt), head_rows=int(rows), tokenizer=False)
            for width in map(int, a.widths.split(",")):
                for growth, n in runs:
                    bestfirst.feed = own if n is None else lambda budget, n=n: n
                    acc, fw = accepted(draft.model, prompts, conts, TreeConfig(width=width, growth=growth))
                    label = growth if n is None else f"best, {n} a forward"
                    print(f"| {fmt}, head {rows} | {width} | {label} | {acc:.2f} | {fw:.1f} |", flush=True)
    finally:
        bestfirst.feed = own
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
