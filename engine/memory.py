"""What a run under `--memory-budget` weighs, and the runtime configuration that holds it to its plan.

The plan itself is scheduler/generation/memplan.py (pure arithmetic over byte counts); here the run's
configuration and stores become those byte counts: the target's streamable groups, the draft's
weights (its head cut to FR-Spec's rows), the KV caches at the run's context, the overheads measured
on this machine.
"""

from __future__ import annotations

import dataclasses

import psutil

from common.errors import CadenceError
from common.settings import WIDER
from common.units import machine_memory

from engine.config import RunConfig
from models.store import WeightStore
from scheduler.runtime_config import MemoryConfig, PipelineConfig, RuntimeConfig, TraceConfig
from speculative.loop import slack

DRAFT_VOCAB = 32768  # FR-Spec: the draft's head keeps this many of the most frequent tokens
TRACE_EVENTS = 16384  # trace events the scheduler holds before it spills them to disk (scheduler/trace.py)


def kv_rows(cfg: RunConfig, draft: bool = False) -> int:
    """KV cache rows a generation may fill (speculative/loop.py sizes the caches the same way): the context
    and a tree's slack; the draft sees only the prompt's last `prompt_window` tokens of it."""
    rows = cfg.context
    if draft and cfg.tree.prompt_window:
        rows = min(rows, cfg.tree.prompt_window + (cfg.max_new_tokens or rows))
    return rows + slack(cfg.tree)


def draft_rows(cfg: RunConfig, draft: WeightStore | None) -> int:
    """Token rows the draft's head keeps (0: all): FR-Spec's frequent-token head, resident or under a budget (a
    draft forward reads its whole head: cut to the frequent tokens, a 0.5B draft's step costs a fifth less)."""
    if draft is None:
        return 0
    rows = cfg.draft_vocab if cfg.draft_vocab is not None else DRAFT_VOCAB
    return 0 if rows >= draft.args.vocab_size else rows


def uses_flash_draft(cfg: RunConfig) -> bool:
    """`--draft flash`: the target's own sparse FFN drafts (models/flash/sparse_target.py)."""
    return cfg.speculative and cfg.draft == "flash"


def flash_choices(cfg: RunConfig, target: WeightStore) -> list[tuple[str, int]]:
    """(predictor, neurons a layer its caches hold) that a budgeted `--draft flash` tries, best first: the
    store's predictors from the best (models/flash/footprint.py `predictors`), each with caches of CACHE_TOKENS
    tokens' neurons, then of one token's (the least a draft step computes from)."""
    from models.flash.footprint import CACHE_TOKENS, predictors, top_k

    f = target.args.ffn_dim
    k = top_k(cfg.ffn_density, f)
    caps = [0] if cfg.ffn_density >= 1.0 else sorted({min(f, n * k) for n in range(CACHE_TOKENS, 0, -1)}, reverse=True)
    return [(p, c) for p in predictors(target) for c in caps]


def least_flash_choice(cfg: RunConfig, target: WeightStore) -> tuple[str, int]:
    """The flash draft's smallest choice: the smallest predictor, one token's neurons cached."""
    from models.flash.footprint import predictor_bytes

    return min(flash_choices(cfg, target), key=lambda c: (predictor_bytes(target, c[0]), c[1]))


def plan_inputs(
    cfg: RunConfig, target: WeightStore, draft: WeightStore | None, overheads=None, flash: tuple[str, int] = ()
) -> dict:
    """What the memory plan of `cfg` weighs (scheduler/generation/memplan.py `plan_memory`'s arguments).
    `flash`: with `--draft flash`, its predictor and the neurons a layer its caches hold (default: the
    first of `flash_choices`)."""
    from scheduler.generation.footprint import measure_overheads

    groups = {g: target.groups[g].nbytes for g in target.group_names() if g != "embed" and not g.startswith("expert.")}
    experts = {g: target.groups[g].nbytes for g in target.group_names() if g.startswith("expert.")}
    draft_w = rows = 0
    if uses_flash_draft(cfg):  # the target's attention, head rows, predictor and caches (models/flash/sparse_target.py)
        from models.flash.footprint import draft_bytes

        draft, rows = target, draft_rows(cfg, target)
        draft_w = draft_bytes(target, *(flash or flash_choices(cfg, target)[0]), rows or None)
    elif draft is not None:
        rows = draft_rows(cfg, draft)
        draft_w = sum(n for g, n in draft.group_bytes().items() if g != "embed" and not g.startswith("head."))
        draft_w += draft.head_bytes(rows or None)
    trie = 8 * cfg.context if cfg.tree.trie and cfg.mode == "tree" else 0
    prompt = cfg.context - (cfg.max_new_tokens or 0)  # the longest prompt, where the new tokens are known
    o = overheads or measure_overheads(
        target.args.to_dict(),
        draft.args.to_dict() if draft else None,
        width=cfg.tree.budget,
        context=prompt,
        greedy=cfg.sampling.greedy and not cfg.plan_sampling,
        draft_window=cfg.tree.prompt_window,
        draft_vocab=rows,
        head_part=max(hi - lo for lo, hi in map(target.head_rows, target.head_groups())),
        trie_nodes=trie,
        trace_events=TRACE_EVENTS + 2048,
    )  # the sink's and the scheduler's own, before they move on
    return {
        "target_groups": groups,
        "draft_weights": draft_w,
        "draft_kv": draft.args.kv_bytes(kv_rows(cfg, draft=True)) if draft else 0,
        "target_kv": target.args.kv_bytes(kv_rows(cfg)),
        "overheads": o,
        **({"experts": experts, "experts_used": target.args.n_experts_used} if experts else {}),
    }


def memory_plan(cfg: RunConfig, target: WeightStore, draft: WeightStore | None, overheads=None, flash=()):
    """The plan for --memory-budget (`auto`: the smallest budget that works and half of the target). With
    `--draft flash`, the first of `flash_choices` that fits, unless `flash` says which."""
    from common.units import parse_bytes
    from scheduler.generation.memplan import plan_memory, smallest_budget

    if uses_flash_draft(cfg) and not flash:  # the best predictor and largest caches the budget holds beside the target
        least = least_flash_choice(cfg, target)
        # this machine's overheads, measured once for every choice (they weigh the same draft shape)
        overheads = overheads or plan_inputs(cfg, target, draft, None, least)["overheads"]
        for choice in flash_choices(cfg, target):
            try:
                return memory_plan(cfg, target, draft, overheads, choice)
            except CadenceError as e:
                if choice == least:
                    refused = e  # the least the draft would take, and what it needs
        raise refused
    inputs = plan_inputs(cfg, target, draft, overheads, flash)
    if cfg.memory_budget == "auto":
        every = sum(inputs["target_groups"].values()) + sum(inputs.get("experts", {}).values())
        budget = smallest_budget(**inputs) + every // 2
    else:
        budget = parse_bytes(cfg.memory_budget)
    plan = plan_memory(budget, **inputs)
    return dataclasses.replace(plan, draft_choice=flash) if flash else plan


def flash_choice(cfg: RunConfig, target: WeightStore, plan) -> tuple[str, int]:
    """(predictor, neurons a layer its caches hold) of the flash draft: the choice `memory_plan` made under a
    plan; with none, the best predictor and every neuron of a layer (a resident run: the caches may keep all
    they ever load). One sentence where the target cannot have a flash draft (no bundles, no predictor)."""
    from models.flash.footprint import best_predictor, check

    check(target)
    return plan.draft_choice if plan is not None else (best_predictor(target), target.args.ffn_dim)


def runtime_config(cfg: RunConfig, target: WeightStore, plan, preload: tuple[str, ...]) -> RuntimeConfig:
    """The scheduler's configuration: under a plan, its budget per role, arena, loader region and expert
    buffer; without one, the machine's memory and an arena for the exchange (and the worker's KV cache).
    `preload`: the modules the actors' zygote imports once."""
    trace = TraceConfig(enabled=cfg.trace, dir=cfg.trace_dir, spill_events=TRACE_EVENTS if plan else 0)
    if plan is None:
        # with the worker, the KV cache lives in the arena, and so do the split's buffers (Q, chunk states, columns)
        extra = target.args.kv_bytes(kv_rows(cfg)) + (64 << 20) if cfg.worker else 0
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


def _pinned(cfg: RunConfig, budget: int) -> RunConfig | None:
    """`cfg` with an `auto` budget pinned to the bytes the choices were weighed under (a later plan of the changed
    run would find its own smallest); None where that many bytes could not be given as a budget here."""
    if cfg.memory_budget != "auto":
        return cfg
    return cfg.replace(memory_budget=str(budget)) if budget <= machine_memory() else None


def _measured(r, say):
    """This machine's costs for the run's pair, or None where measuring failed (the choices are optional: the
    run keeps what was asked, and says why)."""
    from engine.costs import costs

    try:
        return costs(r.target, r.draft, say)
    except CadenceError as e:
        say(f"{e}: the draft and width stay as asked (--draft NAME and --width N skip the measurement)")
        return None


def settle(r, say) -> None:
    """The choices a budgeted run makes from this machine's measured costs, in order: whether the draft
    `--draft auto` picked stays, then the width of a tree whose width was not given. Each said in one line."""
    settle_draft(r, say)
    settle_width(r, say)


def settle_draft(r, say) -> None:
    """Under a budget, the draft `--draft auto` picked stays only where it pays for the target layers its memory
    pushes out to disk (engine/costs.py: this machine's forward costs and disk rate against the two plans):
    else tree mode runs with the n-gram trie alone, whose plan is the target's alone, and says so in one line."""
    if not (r.draft_picked and r.cfg.memory_budget) or r.target.args.moe:
        return  # a mixture of experts: its expert buffer, not its layers, is what the draft's memory takes
    from engine.costs import draft_pays
    from scheduler.generation.memplan import plan_memory

    alone = r.cfg.replace(draft="none")
    try:
        with_draft = memory_plan(r.cfg, r.target, r.draft)
    except CadenceError as e:
        with_draft, lean_refused = _leaner_draft(r, say)
        if with_draft is None:
            return _without_room(r, say, alone, lean_refused or e)
    try:
        without = plan_memory(with_draft.budget, **plan_inputs(alone, r.target, None))
    except CadenceError:
        return  # the plan does not fit: the run says so in its own words
    if with_draft.read_per_forward <= without.read_per_forward:
        return  # the draft pushes nothing of the target out: the governor weighs it step by step
    alone, c = _pinned(alone, with_draft.budget), _measured(r, say)
    if alone is None or c is None:
        return
    if not draft_pays(c, r.target, r.draft, with_draft.read_per_forward, without.read_per_forward, r.cfg.tree.width):
        say(
            f"draft: none (under {with_draft.budget / 2**30:.2f} GiB the draft {r.cfg.draft} would push "
            f"{(with_draft.read_per_forward - without.read_per_forward) / 2**20:.0f} MiB more of the target to disk "
            "every forward than it saves here; --draft NAME keeps it)"
        )
        r.cfg, r.draft, r.draft_picked = alone, None, False


LEAN_FORMAT = "int2"  # the draft's FFN in 2 bits: the 0.5B's weights 215 -> 142 MiB, top-1 agreement 0.87 -> 0.80
LEAN_VOCAB = DRAFT_VOCAB // 2  # and its head half the rows: 8 MiB less, agreement 0.78 (BENCHMARKS.md)


def _may_go_lean(cfg: RunConfig) -> bool:
    """The draft's format and head were not given, and it is not lean already."""
    return cfg.draft_dtype is None and cfg.draft_format != LEAN_FORMAT and cfg.draft_vocab is None


def _leaner_draft(r, say):
    """The budget cannot hold the draft `--draft auto` picked: the same draft leaner where its format and head
    were not given (its FFN in int2, then its head cut to LEAN_VOCAB rows), the first whose plan fits, said in
    one line. Where the run may widen its tree (`settle_width`), the first that leaves room for the widest tree
    comes first: a wider best-first tree is worth more than the head's rarest tokens (BENCHMARKS.md).
    (its plan, None) or (None, why the leanest does not fit; None where no leaner draft was tried).
    A lean draft agrees with the target less, and still beats the trie alone at a budget that streams every
    target layer (BENCHMARKS.md: 0.5 GiB)."""
    from models.convert import ensure_store

    cfg, refused = r.cfg, None
    if not _may_go_lean(cfg):
        return None, None
    store = ensure_store(cfg.draft, LEAN_FORMAT)
    widths = [w for w in WIDER if w > cfg.tree.width] if _widens(cfg) else []
    for width, vocab in [(w, v) for w in widths + [0] for v in (None, LEAN_VOCAB)]:
        lean = cfg.replace(draft_dtype=LEAN_FORMAT, draft_vocab=vocab)
        head = f", its head the {vocab} most frequent tokens" if vocab else ""
        try:
            if width:  # room for the wider tree; the run keeps the default width until `settle_width`
                memory_plan(
                    lean.replace(tree=dataclasses.replace(cfg.tree, width=width, width_auto=False)), r.target, store
                )
            plan = memory_plan(lean, r.target, store)
        except CadenceError as e:
            refused = CadenceError(f"even in {LEAN_FORMAT}{head}, {e}")
            continue
        room = f", room for a {width}-wide tree" if width and vocab else ""
        say(
            f"draft: {cfg.draft} {LEAN_FORMAT} (its FFN in 2 bits{head}{room}: {plan.budget / 2**20:.0f} MiB cannot "
            f"hold it in {cfg.draft_format}; --draft-dtype F keeps a format)"
        )
        r.cfg, r.draft = lean, store
        return plan, None
    return None, refused


def prepare_drafts(r, say) -> None:
    """What a budgeted run's choice of draft reads, made ready: this machine's costs for its draft and, where
    `--draft auto` picked it, the lean draft's store (converted on first use) and costs."""
    from engine.costs import costs
    from models.convert import ensure_store

    lean = [ensure_store(r.cfg.draft, LEAN_FORMAT)] if r.draft_picked and _may_go_lean(r.cfg) else []
    for draft in [r.draft, *lean]:
        costs(r.target, draft, say)


def _without_room(r, say, alone: RunConfig, why: CadenceError) -> None:
    """The budget cannot hold the draft `--draft auto` picked: tree mode runs with the n-gram trie alone where the
    target's plan alone fits (a run that was not asked for a draft still runs), and says so in one line; where
    not even that fits, the run says so in its own words."""
    try:
        memory_plan(alone, r.target, None)
    except CadenceError:
        return
    say(f"draft: none (with the draft {r.cfg.draft}, {why}; --draft NAME keeps it)")
    r.cfg, r.draft, r.draft_picked = alone, None, False


def _widens(cfg: RunConfig) -> bool:
    """A tree whose width was not given, that a budgeted run may widen (`settle_width`)."""
    t = cfg.tree
    return t.width_auto and t.adaptive and bool(cfg.memory_budget) and cfg.mode == "tree"


def settle_width(r, say) -> None:
    """Under a budget, a tree whose width was not given verifies the widest of WIDER draft tokens whose pass this
    machine computes in less time than the disk takes to read what every forward streams (engine/costs.py): the
    wider tree is then free, and accepts more per verification; its growth `auto` becomes best first there
    (BENCHMARKS.md: more accepted at the same price). A width is
    passed over where its plan does not fit the budget, reads more per forward, or its pass and its extra draft
    levels would outlast the reads; the default stays with `--fixed-width` (no governor to fall back to
    narrower trees) or a mixture of experts (a wider tree's union of experts reads more)."""
    t = r.cfg.tree
    if not (_widens(r.cfg) and r.draft is not None) or r.target.args.moe:
        return
    from scheduler.generation.memplan import plan_memory

    try:
        narrow = memory_plan(r.cfg, r.target, r.draft)
    except CadenceError:
        return  # the plan does not fit: the run says so in its own words
    if not narrow.read_per_forward:
        return  # all resident: the governor weighs each width
    c, growth = None, "best" if t.growth == "auto" else t.growth  # a wider best-first tree accepts more, same price
    for width in (w for w in WIDER if w > t.width):
        tree = dataclasses.replace(t, width=width, width_auto=False, growth=growth)
        wide = _pinned(r.cfg.replace(tree=tree), narrow.budget)
        try:
            plan = plan_memory(narrow.budget, **plan_inputs(wide, r.target, r.draft)) if wide else None
        except CadenceError:
            continue  # the wider tree's activations do not fit beside the rest
        if plan is None or plan.read_per_forward > narrow.read_per_forward:
            continue  # the wider activations push a layer out
        c = c or _measured(r, say)
        if c is None:
            return
        verify, read = c.hidden_by_reads(r.target.args.n_layers, width + 1, plan.read_per_forward)
        verify += (width - t.width) // 2 * c.draft_step_s(r.draft)  # the extra levels of the wider tree
        if verify < read:
            say(
                f"width: {width} (this machine verifies {width + 1} rows in {verify * 1e3:.0f} ms, less than the "
                f"{read * 1e3:.0f} ms the disk takes for the {plan.read_per_forward / 2**20:.0f} MiB each forward "
                "streams)"
            )
            r.cfg = wide
            return
