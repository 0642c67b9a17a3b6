"""The quality of `--mode flash`, measured as LLM in a flash measures it (§4.1): against the dense target.

For each prompt the dense target writes its greedy continuation; the flash model then reads the same
prompt (its prompt pass is dense) and is fed that continuation token by token (teacher forcing: each step
is a sparse pass of one row, as in generation). Per density:
- agreement: the share of steps whose top-1 token is the dense target's;
- perplexity of the dense continuation under the flash model, beside the dense model's own;
- what the flash FFNs read per step (bundles) and their cache hit rate.
No memory limit here: the caches hold every neuron they meet (the bound under a budget is the cgroup bench's).
"""

from __future__ import annotations

import math

import torch

from models.transformer import Transformer


def continuation(model: Transformer, ids: list[int], n: int, stop: set[int]) -> list[int]:
    cache = model.new_cache(len(ids) + n + 1)
    logits = model.forward(torch.tensor(ids), torch.arange(len(ids)), cache, logits_rows=slice(-1, None))
    cache.commit()
    out = []
    for _ in range(n):
        t = int(logits[-1].argmax())
        out.append(t)
        if t in stop:
            break
        pos = torch.tensor([cache.length])
        logits = model.forward(torch.tensor([t]), pos, cache)
        cache.commit()
    return out


def _forced(model: Transformer, ids: list[int], cont: list[int]) -> tuple[list[int], list[float]]:
    """Top-1 tokens and log-probabilities of `cont` under `model`, fed one token a step after the prompt."""
    cache = model.new_cache(len(ids) + len(cont) + 1)
    logits = model.forward(torch.tensor(ids), torch.arange(len(ids)), cache, logits_rows=slice(-1, None))
    cache.commit()
    tops, lps = [], []
    for j, t in enumerate(cont):
        lp = torch.log_softmax(logits[-1].double(), -1)
        tops.append(int(lp.argmax()))
        lps.append(float(lp[t]))
        if j + 1 < len(cont):
            logits = model.forward(torch.tensor([t]), torch.tensor([cache.length]), cache)
            cache.commit()
    return tops, lps


def quality(
    dense: Transformer, flash_models: dict, prompts: list[list[int]], tokens: int, stop: set[int], others=None
) -> list:
    """Rows per flash model ({label: (Transformer, FlashWeights)}), one for the dense model, and one per other
    model ({label: Transformer}: a draft model sharing the tokenizer, as a draft's top-1 agreement)."""
    conts = [continuation(dense, ids, tokens, stop) for ids in prompts]
    ref = [_forced(dense, ids, c) for ids, c in zip(prompts, conts)]
    n = sum(len(c) for c in conts)
    rows = [_row("dense", ref, ref, n)]
    for label, (model, weights) in flash_models.items():
        weights.reset_stats()
        got = [_forced(model, ids, c) for ids, c in zip(prompts, conts)]
        st = weights.stats
        row = _row(label, got, ref, n)
        row.update(
            density=weights.density,
            hit_rate=round(st.hit_rate, 4),
            bundle_mb_per_token=round(st.bundles.bytes / max(1, st.sparse_passes / weights.args.n_layers) / 2**20, 2),
        )
        rows.append(row)
    for label, model in (others or {}).items():
        rows.append(_row(label, [_forced(model, ids, c) for ids, c in zip(prompts, conts)], ref, n))
    return rows


def _row(label: str, got, ref, n: int) -> dict:
    agree = sum(a == b for (ta, _), (tb, _) in zip(got, ref) for a, b in zip(ta, tb))
    nll = -sum(lp for _, lps in got for lp in lps)
    return {
        "model": label,
        "tokens": n,
        "agreement": round(agree / max(1, n), 4),
        "perplexity": round(math.exp(nll / max(1, n)), 4),
    }


def main(argv=None) -> int:
    """python -m bench.flash_quality [--target M] [--densities 0.3,0.5] [--prompts P] [--tokens N] [--limit K]"""
    import argparse
    import json
    import sys

    from engine.config import RunConfig
    from engine.prompts import load_prompts
    from engine.inputs import read_inputs
    from engine.machine import ThisMachine
    from formats import loading
    from flash.predictor import Predictor
    from flash.weights import FlashWeights

    ap = argparse.ArgumentParser(prog="python -m bench.flash_quality", description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=RunConfig().target)
    ap.add_argument("--densities", default="0.3,0.5")
    ap.add_argument("--prompts", default="engine/assets/heldout.jsonl")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--limit", type=int, default=0)
    ap.add_argument("--predictor", default=None, help="the predictor: int2, or rN (rank N); default: the best trained")
    ap.add_argument("--draft", default=None, help="also a draft model's agreement (e.g. qwen2.5-coder-0.5b)")
    a = ap.parse_args(argv)
    prompts = load_prompts(a.prompts)[: a.limit or None]
    r = read_inputs(
        RunConfig.from_options(target=a.target, mode="flash", max_new_tokens=a.tokens), ThisMachine(), prompts
    )
    ids = [r.prompt_ids(p)[0] for p in prompts]
    dense = loading.load_store(r.target).model
    pred = Predictor.load(r.target, a.predictor)
    flash = {}
    for d in (float(x) for x in a.densities.split(",")):
        w = FlashWeights(r.target, pred, d)
        w.allocate(r.target.args.ffn_dim)
        flash[f"flash@{d:g}"] = (Transformer(r.target.args, w), w)
    others = {a.draft: loading.load(a.draft, "int4").model} if a.draft else None
    rows = quality(dense, flash, ids, a.tokens, set(r.tokenizer.stop_ids), others)
    print(f"predictor {pred.name}, recall@{pred.density:g} {pred.recall.get('mean', 0):.3f}", file=sys.stderr)
    print(
        "| model | tokens | agreement | perplexity | hit rate | bundle MB a token |\n| --- | ---: | ---: | ---: | ---: | ---: |"
    )
    for row in rows:
        print(
            f"| {row['model']} | {row['tokens']} | {row['agreement']:.3f} | {row['perplexity']:.3f} | "
            f"{row.get('hit_rate', '')} | {row.get('bundle_mb_per_token', '')} |"
        )
    print(json.dumps(rows), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
