"""`launch bench`'s suites: our modes and other engines side by side in one run.

  modes      target, chain, tree (one runtime, same weights) beside HF transformers target-only, assisted
             generation and prompt lookup, and llama.cpp, on a prompt set
  formats    target-only tokens/s per weight format for the target and the draft + llama.cpp, the cost of
             one verification pass at widths 1..64 per format, and quality (mean log-likelihood)
  engine     our target-only fp32/bf16 against HF transformers fp32/bf16
  attention  one layer's tree attention: dense masked, naive sparse, our sparse kernel, the
             verifier/worker split (bench/attention.py)

Prompts run one after another and, for each prompt, every engine in turn, so the background load of
a shared machine falls on all of them alike. Other engines run in processes of their own
(bench/peers.py): one that crashes becomes rows that say so. Each suite returns (rows, extra): the
JSON rows of `launch run --json`, and tables and checks to print.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass

from bench.peers import peer_of, start_peers
from common.modes import Mode
from engine.config import RunConfig
from engine.prompts import Prompt
from engine.runner import Runner

SUITES = ("modes", "formats", "engine", "attention")
WIDTHS = (1, 4, 16, 64)


@dataclass(frozen=True)
class BenchOptions:
    modes: tuple[str, ...] = (Mode.TARGET, Mode.CHAIN, Mode.TREE)
    baselines: tuple[str, ...] = ()
    hf_dtype: str = "bf16"
    formats: tuple[str, ...] = ("fp32", "bf16", "int8", "int4")
    repack: bool = True  # llama.cpp repacks its weights (off under a memory limit: the copy would not fit)


def progress(row: dict) -> None:
    what = row.get("error") or f"{len(row['new_token_ids']):>4} tokens {row['tokens_per_s']:>7.2f} tok/s"
    print(f"  {row['id']:<14} {row['mode']:<17} {what}", file=sys.stderr, flush=True)


def _peers(cfg: RunConfig, names, opts: BenchOptions, target: str | None = None, dtype: str | None = None):
    return start_peers(
        list(names),
        target or cfg.target,
        cfg.draft_model,
        dtype or cfg.dtype,
        cfg.threads or os.cpu_count() or 1,
        opts.hf_dtype,
        opts.repack,
    )


def _close(peers: dict) -> None:
    for p in peers.values():
        p.close()


def modes(cfg: RunConfig, prompts: list[Prompt], opts: BenchOptions):
    """Our modes on one runner (the models loaded once) and the other engines, prompt by prompt."""
    rows = []
    run_mode = Mode.TREE if any(m not in (Mode.TARGET, Mode.STD, Mode.STDPL) for m in opts.modes) else opts.modes[0]
    with Runner(cfg.with_mode(run_mode), prompts) as runner:
        peers = _peers(runner.plan.asked.replace(draft=runner.plan.options()["draft"]), opts.baselines, opts)
        try:
            for p in prompts:
                ids, chat = runner.inputs.prompt_ids(p)
                for m in opts.modes:  # each mode prefills the prompt itself, as a new request would
                    rows.append(runner.run(p, mode=m, reuse=False).row)
                    progress(rows[-1])
                for b in opts.baselines:
                    rows.append(peers[peer_of(b)].run(p, b, ids, chat, cfg.max_new_tokens))
                    progress(rows[-1])
        finally:
            _close(peers)
    return rows, {"lossless": lossless_check(rows)}


def lossless_check(rows: list[dict], ref_mode: str = Mode.TARGET) -> dict:
    """Per mode: does every mode of ours give the reference mode's token ids on every prompt (greedy, or sampled with
    the same seed and controls: models/sampling.py)?"""
    ref = {r["id"]: r["new_token_ids"] for r in rows if r["mode"] == ref_mode}
    out = {}
    for r in rows:
        if r["mode"] in (Mode.CHAIN, Mode.TREE, Mode.STDPL) and r["mode"] != ref_mode and r["id"] in ref:
            out.setdefault(r["mode"], []).append(r["new_token_ids"] == ref[r["id"]])
    return {m: all(v) for m, v in out.items()}


def engine(cfg: RunConfig, prompts: list[Prompt], opts: BenchOptions):
    """Our target-only decode in fp32 and bf16 against HF transformers, for the target and the draft."""
    rows = []
    for model in (cfg.target, cfg.draft if cfg.draft not in ("auto", "none") else "qwen2.5-coder-0.5b"):
        for fmt in ("fp32", "bf16"):
            one = cfg.with_mode("target").replace(target=model, dtype=fmt, runtime="inproc", draft="none")
            with Runner(one, prompts) as runner:
                peers = _peers(one, ["hf"] if "hf" in opts.baselines else [], BenchOptions(hf_dtype=fmt), model, fmt)
                try:
                    for p in prompts:
                        rows.append(runner.run(p).row)
                        progress(rows[-1])
                        if peers:
                            ids, chat = runner.inputs.prompt_ids(p)
                            rows.append({**peers["hf"].run(p, "hf", ids, chat, one.max_new_tokens), "mode": "target"})
                            progress(rows[-1])  # compared under the same mode name, told apart by format
                finally:
                    _close(peers)
    return rows, {}


def attention(cfg: RunConfig, prompts: list[Prompt], opts: BenchOptions):
    """The attention of one target layer during tree verification, four ways."""
    from bench import attention as att
    from bench.measure import RTT_S
    from formats.convert import ensure_store

    table = att.run(ensure_store(cfg.target, cfg.dtype).args, RTT_S, cfg.threads or os.cpu_count() or 1)
    return [], {"tables": {"tree attention of one layer (us), " + cfg.target: table}}


def formats(cfg: RunConfig, prompts: list[Prompt], opts: BenchOptions):
    """Formats side by side: decode speed, the verifier's cost curve, quality."""
    from bench.quality import cost_curve, mean_loglik

    from models import kernels

    rows, curve = [], [["model", "format", "kernel path", *[f"width {w} (ms)" for w in WIDTHS]]]
    quality = [["model", "format", "mean log-lik", "perplexity", "delta vs bf16"]]
    for model in (cfg.target, cfg.draft if cfg.draft not in ("auto", "none") else "qwen2.5-coder-0.5b"):
        ll = {}
        for fmt in opts.formats:
            one = cfg.with_mode("target").replace(target=model, dtype=fmt, runtime="inproc", draft="none")
            with Runner(one, prompts) as runner:
                for p in prompts:
                    rows.append(runner.run(p).row)
                    progress(rows[-1])
                lm = runner.session.target
                for path in kernels.host_paths():  # every kernel path this CPU has, side by side
                    with kernels.using(kernels.load(path)):
                        costs = cost_curve(lm.model, WIDTHS)
                    curve.append([model, fmt, path, *[f"{t * 1e3:.1f}" for t in costs]])
                ll[fmt] = mean_loglik(lm, prompts)
        base = ll.get("bf16", ll.get("fp32"))
        for fmt in opts.formats:
            quality.append(
                [
                    model,
                    fmt,
                    f"{ll[fmt]:.4f}",
                    f"{math.exp(-ll[fmt]):.3f}",
                    f"{ll[fmt] - base:+.4f}" if base is not None else "",
                ]
            )
        rows += _llama_rows(cfg.with_mode("target").replace(target=model), prompts, opts, runner)
    return rows, {"tables": {"one verification pass (ms) by width": curve, "quality on the prompts": quality}}


def _llama_rows(cfg: RunConfig, prompts: list[Prompt], opts: BenchOptions, runner: Runner) -> list[dict]:
    if "llama.cpp" not in opts.baselines:
        return []
    peers, rows = _peers(cfg, ["llama.cpp"], opts), []
    try:
        for p in prompts:
            ids, chat = runner.inputs.prompt_ids(p)
            rows.append({**peers["llama.cpp"].run(p, "llama.cpp", ids, chat, cfg.max_new_tokens), "mode": "target"})
            progress(rows[-1])
    finally:
        _close(peers)
    return rows
