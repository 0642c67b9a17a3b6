"""Under a memory budget, the draft and the tree width a run takes, weighed against this machine's measured costs
(engine/costs.py) while `decide` (engine/decide.py) makes the plan: whether the draft `--draft auto` picked pays for
the target layers its memory pushes out to disk (else a leaner draft, else the n-gram trie alone), and the widest
tree this machine verifies in less time than the disk takes to read what every forward streams. Each choice made for
the user is said in one line of the plan's notes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from common.errors import CadenceError
from common.settings import WIDER
from engine.config import RunConfig
from engine.memory import DRAFT_VOCAB, draft_rows, memory_plan, plan_inputs
from engine.plan import Mode
from formats.store import WeightStore

LEAN_FORMAT = "int2"  # the draft's FFN in 2 bits: the 0.5B's weights 215 -> 142 MiB, top-1 agreement 0.87 -> 0.80
LEAN_VOCAB = DRAFT_VOCAB // 2  # and its head half the rows: 8 MiB less, agreement 0.78 (BENCHMARKS.md)
LEAN_KV = "q8"  # then its KV caches as q8_0, 0.53 of f16's (a slot's 2048 rows: 24 -> 13 MiB); it only proposes


@dataclass(frozen=True)
class Choice:
    """A run's choices while `decide` weighs them: the options as far as settled, the draft's store, whether
    `--draft auto` picked it (only then may a budget drop it or make it lean), the budget (None: `auto`)."""

    cfg: RunConfig
    target: WeightStore
    draft: WeightStore | None
    picked: bool
    budget: int | None
    lean: bool = False

    def plan(self, machine, cfg: RunConfig | None = None, draft=..., budget=...):
        """The memory plan of these choices (`cfg`, `draft`, `budget`: another of them instead)."""
        return memory_plan(
            cfg or self.cfg,
            self.budget if budget is ... else budget,
            self.target,
            self.draft if draft is ... else draft,
            machine,
        )


def _pinned(c: Choice, budget: int, machine) -> int | None | bool:
    """The budget another choice is weighed under: an `auto` budget pinned to the bytes the first choice was
    weighed under (a plan of the changed run would find its own smallest); False where that many bytes could
    not be given as a budget here."""
    if c.budget is not None:
        return c.budget
    return budget if budget <= machine.memory else False


def settle_draft(c: Choice, machine, notes: list[str]) -> Choice:
    """Under a budget, the draft `--draft auto` picked stays only where it pays for the target layers its memory
    pushes out to disk (engine/costs.py: this machine's forward costs and disk rate against the two plans):
    else tree mode runs with the n-gram trie alone, whose plan is the target's alone, and says so in one line."""
    if not c.picked or c.target.args.moe:
        return c  # a mixture of experts: its expert buffer, not its layers, is what the draft's memory takes
    from engine.acceptance import expected
    from engine.costs import draft_pays
    from scheduler.generation.memplan import plan_memory

    alone = c.cfg.replace(draft="none")
    try:
        with_draft = c.plan(machine)
    except CadenceError as e:
        c, with_draft, lean_refused = _leaner_draft(c, machine, notes)
        if with_draft is None:
            return _without_room(c, machine, notes, alone, lean_refused or e)
    try:
        without = plan_memory(with_draft.budget, **plan_inputs(alone, c.target, None, machine))
    except CadenceError:
        return c  # the plan does not fit: the run says so in its own words
    if with_draft.read_per_forward <= without.read_per_forward:
        return c  # the draft pushes nothing of the target out: the governor weighs it step by step
    budget = _pinned(c, with_draft.budget, machine)
    costs = machine.costs(c.target, c.draft) if budget is not False else None
    if costs is None:
        return c
    _priced(costs, notes)
    got = expected(c.target.dir, c.draft.dir, draft_rows(c.cfg, c.draft))
    notes.append(got.said)
    reads = with_draft.read_per_forward, without.read_per_forward
    if draft_pays(costs, c.target, c.draft, *reads, c.cfg.tree.width, got.gives, got.alone_gives, got.shape):
        return c
    notes.append(
        f"draft: none (under {with_draft.budget / 2**30:.2f} GiB the draft {c.cfg.draft} would push "
        f"{(reads[0] - reads[1]) / 2**20:.0f} MiB more of the target to disk every forward than its "
        f"{got.gives:.2f} tokens a verification save here; --draft NAME keeps it)"
    )
    return dataclasses.replace(c, cfg=alone, draft=None, picked=False, lean=False, budget=budget)


def _may_go_lean(cfg: RunConfig) -> bool:
    """The draft's format and head were not given, and it is not lean already."""
    return cfg.draft_dtype is None and cfg.draft_format != LEAN_FORMAT and cfg.draft_vocab is None


def _leaner_draft(c: Choice, machine, notes: list[str]):
    """The budget cannot hold the draft `--draft auto` picked: the same draft leaner where its format and head
    were not given (its FFN in int2, then its head cut to LEAN_VOCAB rows; where none of those fits, the same again
    with its KV caches in q8 unless --draft-kv-dtype was given: the draft only proposes, so the text stays the
    target's), the first whose plan fits, said in
    one line. Where the run may widen its tree (`settle_width`), the first that leaves room for the widest tree
    comes first: a wider best-first tree is worth more than the head's rarest tokens (BENCHMARKS.md).
    (the choice, its plan, None) or (the choice, None, why the leanest does not fit; None where none was tried).
    A lean draft agrees with the target less, and still beats the trie alone at a budget that streams every
    target layer (BENCHMARKS.md: 0.5 GiB)."""
    cfg, refused = c.cfg, None
    if not _may_go_lean(cfg):
        return c, None, None
    store = machine.store(cfg.draft, LEAN_FORMAT)
    widths = [w for w in WIDER if w > cfg.tree.width] if _widens(c) else []
    kvs = [None] + ([LEAN_KV] if cfg.device == "cpu" and cfg.draft_kv_dtype is None and cfg.kv_dtype != LEAN_KV else [])
    for kv, width, vocab in [(k, w, v) for k in kvs for w in widths + [0] for v in (None, LEAN_VOCAB)]:
        lean = cfg.replace(draft_dtype=LEAN_FORMAT, draft_vocab=vocab, draft_kv_dtype=kv)
        head = f", its head the {vocab} most frequent tokens" if vocab else ""
        head += f", its KV caches in {kv}" if kv else ""
        try:
            if width:  # room for the wider tree; the run keeps the default width until `settle_width`
                c.plan(machine, lean.replace(tree=dataclasses.replace(cfg.tree, width=width, width_auto=False)), store)
            plan = c.plan(machine, lean, store)
        except CadenceError as e:
            refused = CadenceError(f"even in {LEAN_FORMAT}{head}, {e}")
            continue
        room = f", room for a {width}-wide tree" if width and vocab else ""
        notes.append(
            f"draft: {cfg.draft} {LEAN_FORMAT} (its FFN in 2 bits{head}{room}: {plan.budget / 2**20:.0f} MiB cannot "
            f"hold it in {cfg.draft_format}; --draft-dtype F keeps a format{', --draft-kv-dtype D the caches' if kv else ''})"
        )
        return dataclasses.replace(c, cfg=lean, draft=store, lean=True), plan, None
    return c, None, refused


def _without_room(c: Choice, machine, notes: list[str], alone: RunConfig, why: CadenceError) -> Choice:
    """The budget cannot hold the draft `--draft auto` picked: tree mode runs with the n-gram trie alone where the
    target's plan alone fits (a run that was not asked for a draft still runs), and says so in one line; where
    not even that fits, the run is refused in the words of that plan: the smallest budget it names is the smallest
    any plan of the run reaches, not the one with the draft."""
    try:
        c.plan(machine, alone, None)
    except CadenceError:
        return dataclasses.replace(c, cfg=alone, draft=None, picked=False, lean=False)
    notes.append(f"draft: none (with the draft {c.cfg.draft}, {why}; --draft NAME keeps it)")
    return dataclasses.replace(c, cfg=alone, draft=None, picked=False, lean=False)


def prepare_drafts(cfg: RunConfig, machine) -> None:
    """What a budgeted run's choice of draft reads, made ready: this machine's costs for the draft `auto` picks
    and, where it may go lean, the lean draft's store (converted on first use) and costs. `launch bench --cgroup`
    does this outside the cgroups, where each run then decides for itself."""
    if not (cfg.draft == "auto" and cfg.mode is Mode.TREE):
        return
    name, _ = machine.pick_draft(cfg.target)
    if name is None:
        return
    target = machine.store(cfg.target, cfg.dtype)
    picked = cfg.replace(draft=name)
    drafts = [machine.store(name, picked.draft_format)]
    if _may_go_lean(picked):
        drafts.append(machine.store(name, LEAN_FORMAT))
    for draft in drafts:
        machine.costs(target, draft)


def _widens(c: Choice) -> bool:
    """A tree whose width was not given, that a budgeted run may widen (`settle_width`)."""
    t = c.cfg.tree
    return t.width_auto and t.adaptive and c.cfg.mode is Mode.TREE


def settle_width(c: Choice, machine, notes: list[str]) -> Choice:
    """Under a budget, a tree whose width was not given verifies the widest of WIDER draft tokens whose pass this
    machine computes in less time than the disk takes to read what every forward streams (engine/costs.py): the
    wider tree is then free, and accepts more per verification; its growth `auto` becomes best first there
    (BENCHMARKS.md: more accepted at the same price). A width is passed over where its plan does not fit the
    budget, reads more per forward, or its pass and its extra draft levels would outlast the reads; the default
    stays with `--fixed-width` (no governor to fall back to narrower trees) or a mixture of experts (a wider
    tree's union of experts reads more)."""
    t = c.cfg.tree
    if not (_widens(c) and c.draft is not None) or c.target.args.moe:
        return c
    from scheduler.generation.memplan import plan_memory

    try:
        narrow = c.plan(machine)
    except CadenceError:
        return c  # the plan does not fit: the run says so in its own words
    if not narrow.read_per_forward:
        return c  # all resident: the governor weighs each width
    costs, growth = None, "best" if t.growth == "auto" else t.growth  # a wider best-first tree accepts more
    budget = _pinned(c, narrow.budget, machine)
    if budget is False:
        return c
    n = c.cfg.parallel  # --parallel: every slot's tree in one forward, the rows hidden by the reads shared out
    widths = [w for w in WIDER if w > t.width] if n == 1 else sorted({*WIDER, t.width, 6, 4, 2}, reverse=True)
    for width in widths:
        wide = c.cfg.replace(tree=dataclasses.replace(t, width=width, width_auto=False, growth=growth))
        try:
            plan = plan_memory(narrow.budget, **plan_inputs(wide, c.target, c.draft, machine))
        except CadenceError:
            continue  # the wider tree's activations do not fit beside the rest
        if plan.read_per_forward > narrow.read_per_forward:
            continue  # the wider activations push a layer out
        costs = costs or machine.costs(c.target, c.draft)
        if costs is None:
            return c
        _priced(costs, notes)
        verify, read = costs.hidden_by_reads(c.target.args.n_layers, n * (width + 1), plan.read_per_forward)
        verify += n * max(0, width - t.width) // 2 * costs.draft_step_s(c.draft)  # the wider trees' extra levels
        if verify < read:
            trees = f"{n} trees of {width + 1} rows" if n > 1 else f"{width + 1} rows"
            notes.append(
                f"width: {width} (this machine verifies {trees} in {verify * 1e3:.0f} ms, less than the "
                f"{read * 1e3:.0f} ms the disk takes for the {plan.read_per_forward / 2**20:.0f} MiB each forward "
                "streams)"
            )
            return dataclasses.replace(c, cfg=wide, budget=budget)
    return c


def _priced(costs, notes: list[str]) -> None:
    """The plan's notes say once what the choices were priced with, and when and how it was measured."""
    if costs.describe() not in notes:
        notes.append(costs.describe())
