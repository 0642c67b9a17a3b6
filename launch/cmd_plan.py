"""`launch plan --memory-budget B`: what a run would keep resident and stream, before loading anything.

It reads the weight stores' manifests (converting a model once if it has none yet), loads the
tokenizer as a run's scheduler would (its memory is part of the plan), and prints the plan for the
mode asked for, then the smallest budget each mode works with. No model weights are read and no
actor starts.
"""
from __future__ import annotations

import dataclasses
import sys

from cadence.errors import CadenceError
from launch.options import add_model_args, run_config
from launch.prompts import Prompt, load_prompts, prompt_ids
from launch.runner import MODES, RunConfig, memory_plan, pick_draft, plan_inputs
from models.convert import ensure_store
from models.tokenizer import TextTokenizer
from scheduler.generation.memplan import fmt, smallest_budget


def add_parser(sub):
    p = sub.add_parser("plan", help="the memory plan under a budget (resident, streamed, slots), loading nothing")
    p.add_argument("--mode", default="tree", choices=MODES)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="size the KV caches for this prompt")
    src.add_argument("--prompts", help="size the KV caches for the longest prompt of this JSONL set")
    add_model_args(p)
    p.set_defaults(func=cmd_plan)


def _ranges(names: list[str]) -> str:
    """layer.0 layer.1 layer.2 layer.5 head.0 -> 'layer 0-2, 5; head 0'."""
    out = []
    for kind in ("layer", "head"):
        idx = sorted(int(n.split(".")[1]) for n in names if n.startswith(kind + "."))
        if not idx:
            continue
        runs, start = [], idx[0]
        for a, b in zip(idx, idx[1:] + [None]):
            if b != a + 1:
                runs.append(f"{start}" if start == a else f"{start}-{a}")
                start = b
        out.append(f"{kind} {', '.join(runs)}")
    return "; ".join(out) or "none"


def _stores(cfg: RunConfig):
    target = ensure_store(cfg.target, cfg.fmt)
    if cfg.draft == "auto":
        cfg = dataclasses.replace(cfg, draft=pick_draft(cfg, target, say=lambda line: None))
    draft = ensure_store(cfg.draft, cfg.draft_fmt or cfg.fmt) if cfg.draft_model else None
    return target, draft


def cmd_plan(args) -> int:
    if not args.memory_budget:
        raise CadenceError("launch plan needs --memory-budget (e.g. 768MiB, 2GiB or auto)")
    cfg = run_config(args, args.mode)
    if cfg.draft == "auto":
        cfg = dataclasses.replace(cfg, draft=pick_draft(cfg, ensure_store(cfg.target, cfg.fmt)))
    target, draft = _stores(cfg)
    tok = TextTokenizer(target.tokenizer_info)  # the scheduler holds it during a run: measured with it
    if cfg.plan_context is None:
        prompts = load_prompts(args.prompts) if args.prompts else [Prompt("prompt", "complete", args.prompt)] if args.prompt else []
        longest = max((len(prompt_ids(tok, p, cfg.chat)[0]) for p in prompts), default=1024)
        cfg = dataclasses.replace(cfg, plan_context=longest)
    tok.release_encoder()  # as a run does once its prompts are encoded
    what = f"{cfg.mode} {cfg.target} {cfg.fmt}" + (f", draft {cfg.draft_model} {cfg.draft_fmt or cfg.fmt}" if cfg.draft_model else
                                                    ", no draft model" if cfg.mode == "tree" else "")
    print(f"{what}; KV caches for {cfg.plan_context} prompt + {cfg.max_new_tokens} new tokens")
    failed = None
    try:
        plan = memory_plan(cfg, target, draft)
    except CadenceError as e:
        failed = e
        print(f"  {e}")
    else:
        print(plan.report())
        print(f"  resident: {_ranges(list(plan.resident))}")
        if plan.streamed:
            print(f"  streamed: {_ranges(list(plan.streamed))}, through {plan.n_slots} slots of {fmt(plan.slot_bytes)}; "
                  f"{fmt(plan.read_per_forward)} read per target forward")
        else:
            print("  streamed: nothing (the whole target fits)")
    print("smallest budget per mode:")
    for mode, dr in (("std", None), ("stdpl", None), ("chain", cfg.draft), ("tree", cfg.draft), ("tree", "none")):
        try:
            m = dataclasses.replace(cfg, mode=mode, draft=dr or cfg.draft, tree=dataclasses.replace(
                cfg.tree, mode="chain" if mode == "chain" else "tree"))
            if mode == "chain" and m.draft == "none":
                continue
            t, d = _stores(m)
            label = f"{mode} --draft none" if m.mode == "tree" and m.draft == "none" else mode
            print(f"  {label:<20} {fmt(smallest_budget(**plan_inputs(m, t, d))):>10}")
        except CadenceError as e:
            print(f"  {mode:<20} {e}")
    if failed is not None:
        return 1
    sys.stdout.flush()
    return 0
