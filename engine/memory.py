"""What a run under `--memory-budget` weighs, and the runtime configuration that holds it to its plan.

The plan itself is scheduler/generation/memplan.py (pure arithmetic over byte counts); here the run's
configuration and stores become those byte counts: the target's streamable groups, the draft's
weights (its head cut to FR-Spec's rows), the KV caches at the run's context, the overheads measured
on this machine.
"""

from __future__ import annotations

import dataclasses

import psutil

from common.modes import Mode
from common.errors import CadenceError
from common.settings import PromptCacheConfig
from common.units import fmt

from engine.config import RunConfig
from formats.store import WeightStore
from scheduler.runtime_config import MemoryConfig, PipelineConfig, RuntimeConfig, TraceConfig
from speculative.sides import slack

DRAFT_VOCAB = 32768  # FR-Spec: the draft's head keeps this many of the most frequent tokens
TRACE_EVENTS = 16384  # trace events the scheduler holds before it spills them to disk (scheduler/trace.py)


def kv_rows(cfg, draft: bool = False) -> int:
    """KV cache rows a generation of `cfg` (a RunConfig or a RunPlan: its context, tree and new tokens) may fill
    (speculative/loop.py sizes the caches the same way): the context and a tree's slack; the draft sees only the
    prompt's last `prompt_window` tokens of it. With --parallel, a slot's tree may take the rows of the others'
    (speculative/batch.py `Lockstep.width`): its slack is for that tree, and nothing drafts ahead of a batch."""
    rows = cfg.context
    if draft and cfg.tree.prompt_window:
        rows = min(rows, cfg.tree.prompt_window + (cfg.max_new_tokens or rows))
    tree = cfg.tree
    if cfg.parallel > 1:
        from speculative.batch import WIDEST

        tree = dataclasses.replace(tree, width=min(WIDEST, batch_width(cfg)), ahead=0)  # nothing drafts ahead
    return rows + slack(tree, draft)


def batch_width(cfg) -> int:
    """Draft tokens in one forward: every slot's tree of the run's budget, each with its root (one slot: the tree)."""
    return cfg.parallel * (cfg.tree.budget + 1) - 1


def draft_rows(cfg: RunConfig, draft: WeightStore | None) -> int:
    """Token rows the draft's head keeps (0: all): FR-Spec's frequent-token head, resident or under a budget (a
    draft forward reads its whole head: cut to the frequent tokens, a 0.5B draft's step costs a fifth less)."""
    if draft is None:
        return 0
    rows = cfg.draft_vocab if cfg.draft_vocab is not None else DRAFT_VOCAB
    return 0 if rows >= draft.args.vocab_size else rows


def uses_flash_draft(cfg: RunConfig) -> bool:
    """`--draft flash`: the target's own sparse FFN drafts (flash/sparse_target.py)."""
    return cfg.speculative and cfg.draft == "flash"


def flash_choices(cfg: RunConfig, target: WeightStore) -> list[tuple[str, int]]:
    """(predictor, neurons a layer its caches hold) that a budgeted `--draft flash` tries, best first: the
    store's predictors from the best (flash/footprint.py `predictors`), each with caches of CACHE_TOKENS
    tokens' neurons, then of one token's (the least a draft step computes from)."""
    from flash.footprint import CACHE_TOKENS, predictors, top_k

    f = target.args.ffn_dim
    k = top_k(cfg.ffn_density, f)
    caps = [0] if cfg.ffn_density >= 1.0 else sorted({min(f, n * k) for n in range(CACHE_TOKENS, 0, -1)}, reverse=True)
    return [(p, c) for p in predictors(target) for c in caps]


def least_flash_choice(cfg: RunConfig, target: WeightStore) -> tuple[str, int]:
    """The flash draft's smallest choice: the smallest predictor, one token's neurons cached."""
    from flash.footprint import predictor_bytes

    return min(flash_choices(cfg, target), key=lambda c: (predictor_bytes(target, c[0]), c[1]))


def plan_inputs(
    cfg: RunConfig, target: WeightStore, draft: WeightStore | None, machine, flash: tuple[str, int] = ()
) -> dict:
    """What the memory plan of `cfg` weighs (scheduler/generation/memplan.py `plan_memory`'s arguments), the
    runtime's overheads as `machine` (engine/machine.py) measures them. `flash`: with `--draft flash`, its
    predictor and the neurons a layer its caches hold (default: the first of `flash_choices`)."""
    groups = {g: target.groups[g].nbytes for g in target.group_names() if g != "embed" and not g.startswith("expert.")}
    experts = {g: target.groups[g].nbytes for g in target.group_names() if g.startswith("expert.")}
    draft_w = rows = 0
    if uses_flash_draft(cfg):  # the target's attention, head rows, predictor and caches (flash/sparse_target.py)
        from flash.footprint import draft_bytes

        draft, rows = target, draft_rows(cfg, target)
        draft_w = draft_bytes(target, *(flash or flash_choices(cfg, target)[0]), rows or None)
    elif draft is not None:
        rows = draft_rows(cfg, draft)
        draft_w = sum(n for g, n in draft.group_bytes().items() if g != "embed" and not g.startswith("head."))
        draft_w += draft.head_bytes(rows or None)
    n = cfg.parallel  # slots: each its own KV caches and trie; their trees verified in one forward
    trie = 8 * cfg.context * n if cfg.tree.trie and cfg.mode is Mode.TREE else 0
    prompt = cfg.context - (cfg.max_new_tokens or 0)  # the longest prompt, where the new tokens are known
    o = machine.overheads(
        target,
        draft,
        width=batch_width(cfg),  # the rows of every slot's tree in one forward
        batch_rows=n * (cfg.tree.budget + 1) if n > 1 else 0,  # ... and beside a prompt's chunk
        context=prompt,
        greedy=cfg.sampling.plain and not cfg.plan_sampling,
        draft_window=cfg.tree.prompt_window,
        draft_vocab=rows,
        head_part=max(hi - lo for lo, hi in map(target.head_rows, target.head_groups())),
        trie_nodes=trie,
        trace_events=TRACE_EVENTS + 2048,
        grammar=grammar_bytes(cfg, target, draft),
        prompt_cache=(prompt_cache_of(cfg) or PromptCacheConfig()).ram_bytes,
    )  # the sink's and the scheduler's own, before they move on
    return {
        "target_groups": groups,
        "draft_weights": draft_w,
        "draft_kv": n * draft.args.kv_bytes(kv_rows(cfg, draft=True), cfg.draft_kv) if draft else 0,
        "target_kv": n * target.args.kv_bytes(kv_rows(cfg), cfg.kv_dtype),
        "overheads": o,
        **({"experts": experts, "experts_used": target.args.n_experts_used} if experts else {}),
    }


PROMPT_CACHE_RAM = 512 << 20  # the prompt cache's memory without a budget, unless --prompt-cache-ram says


def prompt_cache_of(cfg: RunConfig) -> PromptCacheConfig | None:
    """The prompt cache `cfg` keeps (speculative/prefixes.py), or None. `auto`: where the run serves requests (its
    plan makes room for their sampling: serve, chat, cadence.LLM) or its memory is given, in memory without a budget
    and on disk under one (where every byte of memory is a resident layer's); a folder: on disk there too, found
    again by later runs."""
    from common.paths import home, writable_dir
    from common.units import parse_bytes

    asked, given = cfg.prompt_cache, cfg.prompt_cache_ram
    ram = parse_bytes(given) if given is not None else 0 if cfg.memory_budget else PROMPT_CACHE_RAM
    if asked == "off" or (asked == "auto" and not cfg.plan_sampling and given is None):
        return None
    folder = (
        None if asked == "auto" and not cfg.memory_budget else home() / "prompt-cache" if asked == "auto" else asked
    )
    if folder is not None:
        from pathlib import Path

        if Path(folder).exists() and not Path(folder).is_dir():
            raise CadenceError(f"--prompt-cache {folder} is a file; give a folder (or auto, or off)")
        writable_dir(Path(folder))
    return PromptCacheConfig(ram, None if folder is None else str(folder)) if ram or folder else None


def prompt_cache_words(pc: PromptCacheConfig, token_bytes: int) -> str:
    """What `launch plan` says of the prompt cache: where its entries live, and about how many tokens each holds."""
    tiers = []
    if pc.ram_bytes:
        tiers.append(f"{fmt(pc.ram_bytes)} in memory (~{pc.ram_bytes // token_bytes} tokens' rows)")
    if pc.dir:
        most = pc.disk_bound
        tiers.append(f"up to {fmt(most)} on disk in {pc.dir} (~{most // token_bytes} tokens' rows)")
    return "prompt cache (prompts' rows kept past their slot): " + ", and ".join(tiers)


def grammar_bytes(cfg: RunConfig, target: WeightStore, draft: WeightStore | None) -> int:
    """What a run that may match grammars (one given, or requests that may send one) holds for them
    (speculative/grammar.py): one view of the vocabulary for the model actors (the zygote makes it before they fork), one
    more for a scheduler whose trie drafts alone."""
    if not (cfg.sampling.grammar or cfg.plan_sampling):
        return 0
    from speculative.grammar import vocabulary_bytes

    copies = 1 + (draft is None and cfg.speculative and not uses_flash_draft(cfg))
    return copies * vocabulary_bytes(str(target.dir), target.args.vocab_size)


def memory_plan(cfg: RunConfig, budget: int | None, target: WeightStore, draft: WeightStore | None, machine, flash=()):
    """The plan of `cfg` under `budget` bytes (None: `auto`, the smallest budget that works and half of the
    target). With `--draft flash`, the first of `flash_choices` that fits, unless `flash` says which."""
    from scheduler.generation.memplan import plan_memory, smallest_budget

    if uses_flash_draft(cfg) and not flash:  # the best predictor and largest caches the budget holds beside the target
        least = least_flash_choice(cfg, target)
        for choice in flash_choices(cfg, target):
            try:
                return memory_plan(cfg, budget, target, draft, machine, choice)
            except CadenceError as e:
                if choice == least:
                    refused = e  # the least the draft would take, and what it needs
        raise refused
    inputs = plan_inputs(cfg, target, draft, machine, flash)
    if budget is None:
        every = sum(inputs["target_groups"].values()) + sum(inputs.get("experts", {}).values())
        budget = smallest_budget(**inputs) + every // 2
    plan = plan_memory(budget, **inputs)
    return dataclasses.replace(plan, draft_choice=flash) if flash else plan


def flash_choice(cfg: RunConfig, target: WeightStore, plan) -> tuple[str, int]:
    """(predictor, neurons a layer its caches hold) of the flash draft: the choice `memory_plan` made under a
    plan; with none, the best predictor and every neuron of a layer (a resident run: the caches may keep all
    they ever load). One sentence where the target cannot have a flash draft (no bundles, no predictor)."""
    from flash.footprint import best_predictor, check

    check(target)
    return plan.draft_choice if plan is not None else (best_predictor(target), target.args.ffn_dim)


def runtime_config(cfg: RunConfig, target: WeightStore, plan, preload: tuple[str, ...]) -> RuntimeConfig:
    """The scheduler's configuration: under a plan, its budget per role, arena, loader region and expert
    buffer; without one, the machine's memory and an arena for the exchange (and the worker's KV cache).
    `preload`: the modules the actors' zygote imports once."""
    trace = TraceConfig(enabled=cfg.trace, dir=cfg.trace_dir, spill_events=TRACE_EVENTS if plan else 0)
    if plan is None:
        # with the worker, the KV cache lives in the arena, and so do the split's buffers (Q, chunk states, columns)
        extra = target.args.kv_bytes(kv_rows(cfg), cfg.kv_dtype) + (64 << 20) if cfg.worker else 0
        mem = MemoryConfig(budget_bytes=psutil.virtual_memory().total, arena_bytes=(64 << 20) + extra)
        return RuntimeConfig(memory=mem, trace=trace, preload=preload)
    o = plan.overheads
    roles = {
        "verifier": plan.resident_bytes + plan.target_kv + o.actor + o.verifier_activations,
        "scheduler": o.scheduler + o.watchdog + o.runtime + o.code,
    }
    if plan.has_draft:
        roles["draft"] = plan.draft_weights + plan.draft_kv + o.actor + o.draft_activations
    if plan.streamed or plan.expert_buffer:
        roles["loader"] = o.actor
    mem = MemoryConfig(
        budget_bytes=plan.budget,
        arena_bytes=plan.arena_bytes,
        stream_bytes=plan.stream_bytes,
        expert_bytes=plan.expert_buffer,
        role_bytes=roles,
    )
    return RuntimeConfig(
        memory=mem, pipeline=PipelineConfig(layer_bytes=plan.slot_bytes or (1 << 20)), trace=trace, preload=preload
    )


SLOTS = 4  # the most generations at once `--parallel 0` picks (llama-server's `-np` auto takes 4 too)
SLOT_CONTEXT = 512  # tokens a slot holds at the least (under a budget the default context is shared out)


def most_slots(
    cfg: RunConfig, machine, prompt_lengths: tuple[int, ...], decide, context
) -> tuple[int, int | None, str]:
    """`--parallel 0` (`launch serve`'s default): as many slots as the run's memory allows, the context each holds
    where it is shorter than the budget's default share (None: the default), and the line that says why;
    `decide`, `context`: engine/decide.py's (the plan; a run's context, here each slot's default share).

    A slot is a generation under way with KV caches of its own; under a budget their caches and their trees' rows
    take memory the target's layers and the draft would have used, so more slots are not always better: a budget
    that holds four slots only by dropping the draft model serves each request slower than it held one
    (BENCHMARKS.md, "Many requests at once": 0.5 GiB). The choice: the most slots, up to SLOTS, whose plan keeps
    the draft model one slot's plan has and gives each slot at least SLOT_CONTEXT tokens (where no context is
    asked for, a shorter share than the default, down to SLOT_CONTEXT, keeps the draft); resident, SLOTS."""
    alone = _one_at_a_time(cfg, machine)
    if alone:
        return 1, None, f"slots: 1 (--parallel 0: {alone} generates one prompt at a time)"
    if not cfg.memory_budget:
        return SLOTS, None, f"slots: {SLOTS} (--parallel 0, no memory budget)"
    one = decide(cfg.replace(parallel=1), machine, prompt_lengths)
    share = lambda n: context(cfg.replace(parallel=n), one.target, prompt_lengths)  # noqa: E731
    default = cfg.context is None and not (prompt_lengths and cfg.max_new_tokens)  # the budget's context, shared
    n, shorter = SLOTS, None
    while n > 1:
        plan = _slots_plan(cfg, n, None, machine, prompt_lengths, decide)
        if _keeps_draft(plan, one):
            break
        if default:  # a shorter share than the default
            contexts = range(share(n) - SLOT_STEP, SLOT_CONTEXT - 1, -SLOT_STEP)
            plans = (_slots_plan(cfg, n, c, machine, prompt_lengths, decide) for c in contexts)
            shorter = next((p.context for p in plans if _keeps_draft(p, one)), None)
            if shorter:
                break
        n //= 2
    why = "the most of {} the budget holds with {} and at least {} tokens a slot".format(
        SLOTS, "the draft model" if one.draft.model else "the trie", SLOT_CONTEXT
    )
    if shorter:
        why += f"; each holds {shorter} (its share of the default context, {share(n)}, would drop the draft)"
    return n, shorter, f"slots: {n} (--parallel 0: {why})"


SLOT_STEP = 128  # the shorter shares a slot's context is tried at


def slots_without_draft(asked: RunConfig, plan, machine, prompt_lengths, decide) -> list[str]:
    """Where `--parallel N` given by hand leaves no room under the budget for the draft model fewer slots keep: the
    most slots that keep it, in one line (each of N generations runs on the n-gram trie alone, slower than fewer
    with the draft: BENCHMARKS.md, "Many requests at once", 0.5 GiB). `plan`: N slots' (engine/decide.py `_plan`)."""
    wanted = asked.speculative and asked.draft not in ("none", "flash")
    if asked.parallel <= 1 or plan.draft.model or not asked.memory_budget or not wanted:
        return []
    fewer = [asked.parallel >> k for k in range(asked.parallel.bit_length() - 1, 0, -1)]  # 1, ..., N/4, N/2
    n = 0  # upward, so that no plan asked here looks for fewer slots of its own (one that drops the draft would)
    for m in fewer:
        kept = _slots_plan(asked, m, asked.context, machine, prompt_lengths, decide)
        if kept is None or not kept.draft.model:
            break
        n = m
    if not n:
        return []
    return [
        f"slots: {asked.parallel} leave no room for the draft model under this budget, so each generation runs on "
        f"the n-gram trie alone; --parallel {n} keeps the draft (--parallel 0 picks the most that do)"
    ]


def _slots_plan(cfg: RunConfig, n: int, context: int | None, machine, prompt_lengths, decide):
    """The plan of `n` slots of `context` tokens each (None: the default share), or None where none fits."""
    try:
        return decide(cfg.replace(parallel=n, context=context), machine, prompt_lengths)
    except CadenceError:
        return None


def _keeps_draft(plan, one) -> bool:
    """Whether a slots' plan keeps one slot's draft model and gives each slot at least SLOT_CONTEXT tokens."""
    return plan is not None and plan.draft.model >= one.draft.model and plan.context >= SLOT_CONTEXT


def _one_at_a_time(cfg: RunConfig, machine) -> str | None:
    """What in `cfg` runs one generation at a time (a batch's forward runs dense blocks on the CPU kernels), if
    anything."""
    if not cfg.mode.batched:
        return f"mode {cfg.mode}"
    if cfg.device != "cpu":
        return f"--device {cfg.device}"
    if cfg.worker is not None:
        return "the sparse worker"
    if cfg.draft == "flash":
        return "--draft flash"
    if machine.store(cfg.target, cfg.dtype).args.moe:
        return "a mixture of experts"
    return None
