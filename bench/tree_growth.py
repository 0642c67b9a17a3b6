"""Tree acceptance by growth policy, teacher-forced: the draft grows a tree at each position of the target's own
greedy continuation, and the tree's accepted length is the longest path that follows it.

    python -m bench.tree_growth [--drafts int2:16384,int4:32768] [--widths 8,16,32] [--tokens 48] [--limit 0]

Every dev and held-out prompt; the target's continuations come from the 1.5B int4 in this process (the same
tokens every run gives: greedy). Each tree is built by the drafter as a run builds it (`Drafter.build_tree`,
the trie included), then advanced by the verdict the target would give, so a policy's figure is what it
accepts per verification in a run, free of the machine's timing. Prints a markdown table.
"""

from __future__ import annotations

import argparse

from bench.flash_quality import continuation
from common.settings import SamplingConfig, TreeConfig
from engine.config import RunConfig
from engine.prompts import load_prompts
from engine.resolve import resolve
from models import engine
from models.convert import ensure_store
from speculative.drafter import Drafter
from speculative.loop import slack
from speculative.tree import ROOT, best_branch

PROMPTS = ("engine/assets/heldout.jsonl", "engine/assets/dev.jsonl")


def accepted(model, prompts: list[list[int]], conts: list[list[int]], cfg: TreeConfig) -> tuple[float, float]:
    """(draft tokens accepted, draft forwards) per verification over the prompts' continuations."""
    acc = verifications = forwards = 0
    for ids, cont in zip(prompts, conts):
        d = Drafter(model, SamplingConfig(), cfg)
        d.start(ids, len(ids) + len(cont) + slack(cfg))
        d.push(cont[:1])
        at = 1
        while at < len(cont):
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
            d.update_threshold(tree, *best_branch(t, path))
            acc, verifications, forwards = acc + len(path), verifications + 1, forwards + tree.forwards
            at += len(new)
    return acc / verifications, forwards / verifications


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.tree_growth", description=__doc__.splitlines()[0])
    ap.add_argument("--drafts", default="int2:16384,int2:32768,int4:32768", help="FORMAT:HEAD_ROWS of the 0.5B draft")
    ap.add_argument("--widths", default="8,16,32")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--limit", type=int, default=0)
    a = ap.parse_args(argv)
    items = [p for f in PROMPTS for p in load_prompts(f)][: a.limit or None]
    r = resolve(RunConfig.from_options(mode="target", max_new_tokens=a.tokens), items)
    prompts = [r.prompt_ids(p)[0] for p in items]
    target = engine.load_store(r.target).model
    conts = [continuation(target, ids, a.tokens, set(r.tokenizer.stop_ids)) for ids in prompts]
    del target
    print(f"{len(prompts)} prompts x {a.tokens} tokens of the target's greedy continuation")
    print("| draft | width | growth | accepted / verification | draft forwards / verification |")
    print("| --- | ---: | --- | ---: | ---: |")
    for spec in a.drafts.split(","):
        fmt, rows = spec.split(":")
        draft = engine.load_store(ensure_store("qwen2.5-coder-0.5b", fmt), head_rows=int(rows), tokenizer=False)
        for width in map(int, a.widths.split(",")):
            for growth in ("best", "pacer"):
                acc, fw = accepted(draft.model, prompts, conts, TreeConfig(width=width, growth=growth))
                print(f"| {fmt}, head {rows} | {width} | {growth} | {acc:.2f} | {fw:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
