"""`decide(config, machine) -> RunPlan`: every choice of a run made once, in one place, from the user's options
(engine/config.py `RunConfig`) and what the machine answers (engine/machine.py), and returned frozen
(engine/plan.py). `launch run`, `chat`, `serve`, `bench`, `plan` and `cadence.LLM` all come here, so they run
what one another plan.

In order: the draft `--draft auto` takes (the default draft where it shares the target's tokenizer, else the
smallest model here that does, else the n-gram trie alone); an ARCA profile's tree and partition; the context
(sized to the longest prompt where the prompts are known); the budget in bytes; under a budget, whether the
picked draft stays (or goes lean) and how wide the tree may grow, each from this machine's measured costs; the
memory plan; the scheduler's settings. A choice made for the user is said in one line of `notes`.
"""

from __future__ import annotations

import dataclasses

from common.errors import CadenceError
from common.settings import WorkerSplit
from common.units import parse_bytes
from engine.config import RunConfig
from engine.drafts import auto_draft
from speculative.grammar import PRELOAD
from engine.memory import (
    draft_rows,
    flash_choice,
    most_slots,
    slots_without_draft,
    prompt_cache_of,
    runtime_config,
    uses_flash_draft,
)
from engine.budget_choice import Choice, settle_draft, settle_width
from engine.plan import DraftKind, DraftPlan, Mode, Runtime, RunPlan
from engine.profiles import parse_partition
from formats.store import WeightStore

DEFAULT_CONTEXT = 4096  # tokens a generation holds when nothing says how many (ollama and llama-cli take as many)
BUDGET_CONTEXT = 2048  # ... under a memory budget, where every token's KV rows are memory the target could use


class BudgetRefused(CadenceError):
    """The budget cannot hold the run: the sentence says what it needs; `plan` is what was decided up to the
    memory plan (the draft, the context: what `launch plan` prints above the sentence)."""

    def __init__(self, message: str, plan: RunPlan):
        super().__init__(message)
        self.plan = plan


def decide(cfg: RunConfig, machine, prompt_lengths: tuple[int, ...] = ()) -> RunPlan:
    """The plan of the run `cfg` asks for on `machine`; `prompt_lengths`: the token counts of the prompts it will
    run, where known (the context is sized to the longest). The same options and machine give the same plan."""
    notes: list[str] = []
    asked = cfg
    if cfg.parallel == 0:  # as many slots as the memory allows
        n, shorter, why = most_slots(cfg, machine, prompt_lengths, decide, context)
        cfg, notes = cfg.replace(parallel=n, context=shorter or cfg.context), [why]
    profile = machine.profile(cfg.profile) if cfg.profile else None
    if cfg.draft_model:  # a draft that cannot serve is refused before any conversion
        machine.check_draft(cfg.target, cfg.draft)
    target = machine.store(cfg.target, cfg.dtype)
    picked = cfg.draft == "auto" and cfg.mode is Mode.TREE
    if cfg.draft == "auto":
        cfg = cfg.replace(draft=auto_draft(cfg, machine, notes) if cfg.speculative else "none")
    draft = machine.store(cfg.draft, cfg.draft_format) if cfg.draft_model else None
    if profile is not None:
        cfg = apply_profile(cfg, profile)
    cfg = cfg.replace(context=context(cfg, target, prompt_lengths))
    auto = cfg.memory_budget == "auto"
    budget = parse_bytes(cfg.memory_budget) if cfg.memory_budget and not auto else None
    c = Choice(cfg, target, draft, picked and draft is not None, budget)
    memory = None
    if cfg.memory_budget and cfg.mode is not Mode.FLASH:  # flash sizes its caches from what it holds (engine/flash.py)
        c = settle_width(settle_draft(c, machine, notes), machine, notes)
        try:
            memory = c.plan(machine)
        except CadenceError as e:
            raise BudgetRefused(str(e), _plan(asked, c, machine, None, budget, notes)) from None
        budget = memory.budget
    plan = _plan(asked, c, machine, memory, budget, notes)
    fewer = slots_without_draft(asked, plan, machine, prompt_lengths, decide)  # where fewer slots keep the draft
    return dataclasses.replace(plan, notes=plan.notes + tuple(fewer)) if fewer else plan


def _plan(asked: RunConfig, c: Choice, machine, memory, budget: int | None, notes: list[str]) -> RunPlan:
    cfg, target, draft = c.cfg, c.target, c.draft
    flash = uses_flash_draft(cfg)
    if flash:
        d = DraftPlan(DraftKind.FLASH, store=target, head_rows=draft_rows(cfg, target), kv_dtype=cfg.draft_kv)
        d = dataclasses.replace(d, flash=(cfg.ffn_density, *flash_choice(cfg, target, memory)))
    elif draft is not None:
        kind = DraftKind.LEAN if c.lean else DraftKind.MODEL
        d = DraftPlan(kind, cfg.draft, draft, cfg.draft_format, draft_rows(cfg, draft), kv_dtype=cfg.draft_kv)
    else:
        d = DraftPlan(DraftKind.TRIE if cfg.speculative else DraftKind.NONE)
    scheduler = None
    if cfg.runtime == "actors" and cfg.mode is not Mode.FLASH:
        from scheduler.generation.footprint import ACTOR_MODULES

        # the model actors fork from one zygote that imported torch and the model code once
        preload = (
            *ACTOR_MODULES,
            *(("actors.sparse",) if cfg.worker else ()),
            *(("flash.sparse_target",) if flash else ()),  # imported once, not in the draft's own pages
            *((f"{PRELOAD}{target.dir}:{target.args.vocab_size}",) if memory and memory.overheads.grammar else ()),
        )
        scheduler = runtime_config(cfg, target, memory, preload)
    return RunPlan(
        asked=asked,
        mode=cfg.mode,
        target_name=cfg.target,
        target=target,
        format=cfg.dtype,
        draft=d,
        tree=cfg.tree,
        sampling=cfg.sampling,
        context=cfg.context,
        max_new_tokens=cfg.max_new_tokens,
        chat=cfg.chat,
        runtime=Runtime(cfg.runtime),
        device=cfg.device,
        threads=cfg.threads or machine.cores,
        parallel=cfg.parallel,
        kv_dtype=cfg.kv_dtype,
        budget=budget,
        memory=memory,
        scheduler=scheduler,
        worker=cfg.worker,
        experts=cfg.experts,
        paths=expert_paths(cfg, target, machine),
        ffn_density=cfg.ffn_density,
        trace=cfg.trace,
        trace_dir=cfg.trace_dir,
        notes=tuple(notes),
        prompt_cache=prompt_cache_of(cfg),
    )


# -- the draft, the profile, the context ---------------------------------------------------------------


def apply_profile(cfg: RunConfig, prof: dict) -> RunConfig:
    """An ARCA profile's choices (launch profile): its width and static tree (tree mode), its partition."""
    tree, worker = cfg.tree, cfg.worker
    if prof["width"] > 0 and cfg.mode is Mode.TREE:
        tree = dataclasses.replace(
            tree,
            width=prof["width"],
            width_auto=False,
            trie=False,
            adaptive=False,
            shape_parents=tuple(prof["tree"]["parents"]),
            shape_ranks=tuple(prof["tree"]["ranks"]),
        )
    if prof["partition"] != "none":
        worker = WorkerSplit(*parse_partition(prof["partition"]))
    return cfg.replace(tree=tree, worker=worker)


def context(cfg: RunConfig, target: WeightStore, prompt_lengths) -> int:
    """Tokens a generation holds: --context; else the longest prompt plus --max-new-tokens where both are
    known; else DEFAULT_CONTEXT (BUDGET_CONTEXT under a memory budget, shared out among --parallel slots; more if
    the longest prompt needs it); at most the model's context. Each slot of a batch holds this many."""
    most = target.args.context_length
    if cfg.context is not None:
        if cfg.context > most:
            raise CadenceError(
                f"--context {cfg.context} is more than {cfg.target} holds ({most} tokens); give at most {most}"
            )
        return cfg.context
    longest = max(prompt_lengths, default=0)
    if longest and cfg.max_new_tokens:
        return min(most, longest + cfg.max_new_tokens)
    base = BUDGET_CONTEXT // cfg.parallel if cfg.memory_budget else DEFAULT_CONTEXT  # slots share a budget's rows
    return min(most, max(base, longest + 512))


def expert_paths(cfg: RunConfig, target: WeightStore, machine):
    """A mixture of experts' path profile, read from beside its store where the buffer's policies use it."""
    e = cfg.experts
    if not target.args.moe or not (e.preload == "paths" or e.eviction == "edgemoe"):
        return None
    paths = machine.expert_paths(target)
    if paths is None and e.preload == "paths":
        raise CadenceError(
            f"--expert-preload paths needs the expert path profile of {target.dir.name}; write it "
            f"with `launch models profile-experts {cfg.target}`"
        )
    return paths
