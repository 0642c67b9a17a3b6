"""`launch plan --memory-budget B`: what a run would keep resident and stream, before loading anything.

It reads the weight stores' manifests (converting a model once if it has none yet), loads the
tokenizer as a run's scheduler would (its memory is part of the plan), and prints the plan for the
mode asked for, then the smallest budget each mode works with. No actor starts; the choices a budgeted
tree makes from this machine's costs may measure them once (engine/costs.py: one layer of each model and a
stretch of the store, in a child process; cached).
"""

from __future__ import annotations

import sys

from common.modes import Mode
from common.errors import CadenceError
from engine.config import RunConfig
from engine.decide import BudgetRefused, decide
from engine.inputs import read_inputs
from engine.machine import ThisMachine
from engine.memory import least_flash_choice, plan_inputs, prompt_cache_words, uses_flash_draft
from engine.plan import RunPlan
from engine.prompts import Prompt, load_prompts
from launch.options import add_run_options, run_config
from common.units import fmt, fmt_up
from scheduler.generation.memplan import smallest_budget


def add_parser(sub):
    p = sub.add_parser("plan", help="the memory plan under a budget (resident, streamed, slots), loading nothing")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="size the KV caches for this prompt")
    src.add_argument("--prompts", help="size the KV caches for the longest prompt of this JSONL set")
    p.add_argument(
        "--for",
        dest="door",
        choices=DOORS,
        default="run",
        help="the command whose plan to show: run (and bench), chat, serve or llm (cadence.LLM); chat, serve and "
        "llm keep room for requests that sample or send a grammar, and serve's --parallel is 0 unless given",
    )
    add_run_options(p, parallel=None)  # None: the door's own (serve: as many slots as the memory allows)
    p.set_defaults(func=cmd_plan)


DOORS = ("run", "chat", "serve", "llm")
SERVING = ("chat", "serve", "llm")  # an LLM behind a terminal, HTTP or Python: requests may sample, send grammars


def door_config(args) -> RunConfig:
    """The configuration `launch <door>` (or `cadence.LLM`) builds from these options: the one a door decides
    from. `launch serve` imports its HTTP front before it decides, so this process holds it too (the plan
    measures the deciding process's own memory)."""
    door = getattr(args, "door", "run")
    cfg = run_config(args, parallel=args.parallel if args.parallel is not None else int(door != "serve"))
    if door not in SERVING:
        return cfg
    from cadence.api import config_of

    if door == "serve":
        import serve.app  # noqa: F401
        import uvicorn  # noqa: F401
    return config_of(cfg)


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


def cmd_plan(args) -> int:
    if not args.memory_budget:
        raise CadenceError("launch plan needs --memory-budget (e.g. 768MiB, 2GiB or auto)")
    prompts = (
        load_prompts(args.prompts)
        if args.prompts
        else [Prompt("prompt", "chat", args.prompt)]  # as `launch run` takes its --prompt (--chat says)
        if args.prompt
        else []
    )
    cfg = door_config(args)
    machine = ThisMachine(print)
    inputs = read_inputs(cfg, machine, prompts)  # the tokenizer is held as a run's scheduler holds it
    inputs.hold_tokenizer(encodes_more=not (args.door == "run" and cfg.memory_budget))  # as that door's run holds it
    failed = None
    try:
        run = decide(cfg, machine, inputs.lengths())  # as a run decides: the `auto` draft, the width, the plan
    except BudgetRefused as e:
        failed, run = e, e.plan
    for line in run.notes:
        print(line)
    print(run.headline())
    if failed is not None:
        print(f"  {failed}")
    elif run.memory is None:  # --mode flash: its caches get what its process leaves of the budget once loaded
        print(
            f"  --mode flash sizes its neuron caches from what its process holds once the model is in, under "
            f"{'the smallest budget that holds a few tokens' if run.budget_auto else fmt(run.budget)}: "
            "`launch run` prints them"
        )
    else:
        _memory(run.memory)
        _by_row(machine.store(cfg.target, cfg.dtype))
    if run.prompt_cache is not None:
        print(f"  {prompt_cache_words(run.prompt_cache, run.target.args.kv_bytes(1, run.kv_dtype))}")
    if args.door not in SERVING and cfg.memory_budget and not failed:
        _served(args, prompts, run)
    _smallest(cfg, machine, run)
    sys.stdout.flush()
    return 1 if failed is not None else 0


def _served(args, prompts: list[Prompt], run: RunPlan) -> None:
    """Where `launch serve` decides otherwise with these options (its requests may sample or send a grammar, and
    the plan keeps room for both; its --parallel is 0 unless given; its process holds the HTTP front), one line
    saying how; `--for serve` shows its plan."""
    import argparse

    cfg = door_config(argparse.Namespace(**{**vars(args), "door": "serve"}))
    machine = ThisMachine(lambda line: None)  # its own process's memory, measured again
    try:
        held = read_inputs(cfg, machine, prompts)
        held.hold_tokenizer(encodes_more=True)  # as a server keeps it
        other = decide(cfg, machine, held.lengths())
    except CadenceError as e:  # the budget refused, or a prompt longer than a slot holds
        print(f"  `launch serve` with these options (room for sampled requests and grammars): {e}")
        return
    if other.memory is None or run.memory is None:
        return

    def words(r: RunPlan) -> str:
        draft = r.draft_words(fmt_=True).lstrip(", ") or "no draft"
        return f"{r.parallel} slot{'s' * (r.parallel > 1)}, {draft}, {len(r.memory.resident)} groups resident"

    if words(other) != words(run):
        print(
            f"  `launch serve` with these options keeps room for sampled requests and grammars "
            f"({fmt(other.memory.overheads.grammar)} for grammars): {words(other)}, against {words(run)} here; "
            "`launch plan --for serve` shows its plan"
        )


def _memory(plan) -> None:
    print(plan.report())
    print(f"  resident: {_ranges(list(plan.resident))}")
    if plan.draft_choice:  # --draft flash
        name, cached = plan.draft_choice
        print(f"  flash draft: the {name} predictor, {cached} neurons a layer in its caches")
    if plan.streamed:
        print(
            f"  streamed: {_ranges(list(plan.streamed))}, through {plan.n_slots} slots of {fmt(plan.slot_bytes)}; "
            f"{fmt(plan.read_per_forward)} read per target forward"
        )
    else:
        print("  streamed: nothing (the whole target fits)")


def _by_row(store) -> None:
    """The tables left on disk and read a row a token (the embeddings; Gemma 4's per-layer embeddings, LLM in a
    flash's way): none of the budget, a few KiB read each token."""
    tables = [("embeddings", "embed"), ("per-layer embeddings", "embed_pl")]
    parts = []
    for label, name in tables:
        if name in store.tensors:
            a = store.tensors[name]["arrays"]["w"]
            parts.append(f"{label} {fmt(a['nbytes'])} ({a['nbytes'] / a['shape'][0] / 1024:.1f} KiB a token)")
    print(f"  on disk, read by the row: {'; '.join(parts)}")


def _smallest(cfg: RunConfig, machine: ThisMachine, run: RunPlan) -> None:
    """The smallest budget each mode works with, for the models this run would load (a speculative mode's draft:
    the one decided, or the one `auto` picks where the budget settled on none)."""
    print("smallest budget per mode:")
    target = machine.store(cfg.target, cfg.dtype)
    sized = cfg.replace(context=run.context, tree=run.tree, worker=run.worker)
    draft, store = cfg.draft, None
    if run.draft.model:
        draft, store = run.draft.name, run.draft.store
        sized = sized.replace(draft_dtype=run.draft.format, draft_vocab=run.draft.head_rows)
    elif draft == "auto":  # what a speculative mode would draft with
        draft = machine.pick_draft(cfg.target)[0] or "none"
    if store is None and draft not in ("none", "flash"):
        store = machine.store(draft, sized.draft_format)
    drafts = store is not None or draft == "flash"  # a draft model, or the target's own sparse FFN
    rows = [(Mode.STD, "none", None), (Mode.STDPL, "none", None)]
    rows += [(Mode.CHAIN, draft, store), (Mode.TREE, draft, store)] if drafts else []
    for mode, name, d in rows + [(Mode.TREE, "none", None)]:
        m = sized.with_mode(mode, draft=name)
        label = f"{mode} --draft {name}" if mode is Mode.TREE and name in ("none", "flash") else mode
        try:
            choice = least_flash_choice(m, target) if uses_flash_draft(m) else ()  # --draft flash: its smallest
            print(f"  {label:<20} {fmt_up(smallest_budget(**plan_inputs(m, target, d, machine, flash=choice))):>10}")
        except CadenceError as e:
            print(f"  {label:<20} {e}")
