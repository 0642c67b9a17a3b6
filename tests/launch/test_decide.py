"""`decide` (engine/decide.py) as a pure function of the options and the machine: the same options on the same
machine give the same `RunPlan`, whichever front door they came through (`launch run`, `chat`, `serve`, `bench`,
`plan`, `cadence.LLM`); the plan is typed (enums, bytes), and what it decided is what the run then does."""

from __future__ import annotations

import json

import pytest

from cadence.api import config_of
from engine.config import RunConfig
from engine.decide import BudgetRefused, decide
from engine.machine import ThisMachine
from engine.options import argv
from engine.plan import DraftKind, Mode, Runtime, RunPlan
from launch.cli import build_parser
from launch.cmd_plan import door_config
from launch.options import run_config
from scheduler.generation.footprint import own_anon_bytes
from tests.launch.conftest import launch

# a run under a budget with a draft model, and one whose `auto` draft finds none (the trie alone)
OPTION_SETS = {
    "draft": lambda m: dict(target=m, draft=m, memory_budget="600MiB", context=512, max_new_tokens=8, width=6),
    "auto": lambda m: dict(target=m, memory_budget="auto", context=256, max_new_tokens=8, temperature=0.7, seed=3),
    "resident": lambda m: dict(target=m, draft=m, mode="chain", chain_k=3, max_new_tokens=8),
}


# the scheduler's own bytes as this process held them when the tests were collected: by the time a test here
# runs, the tests before it may have loaded models into this process (gigabytes no run's scheduler holds)
OWN = own_anon_bytes()


@pytest.fixture(scope="module")
def machine():
    return ThisMachine(say=lambda line: None, own=OWN)


@pytest.mark.parametrize("name", list(OPTION_SETS))
def test_the_same_options_and_machine_give_the_same_plan(tiny_gguf, machine, name):
    cfg = RunConfig.from_options(**OPTION_SETS[name](str(tiny_gguf)))
    first, again = decide(cfg, machine), decide(cfg, machine)
    assert isinstance(first, RunPlan) and first == again
    assert first.asked == cfg  # the options stay what was asked
    assert isinstance(first.mode, Mode) and isinstance(first.draft.kind, DraftKind) and first.runtime is Runtime.ACTORS
    assert first.context == (cfg.context or min(4096, first.target.args.context_length)) and first.threads >= 1
    if cfg.memory_budget:
        assert isinstance(first.budget, int) and first.memory.budget == first.budget and first.scheduler is not None
        assert first.scheduler.memory.budget_bytes == first.budget
    else:
        assert first.budget is None and first.memory is None
    # another machine object over the same machine makes the same choices (its overheads measured afresh)
    other = decide(cfg, ThisMachine(say=lambda line: None, own=OWN))
    assert (other.mode, other.draft, other.tree, other.context, other.budget is None) == (
        first.mode,
        first.draft,
        first.tree,
        first.context,
        first.budget is None,
    )


def test_the_plan_says_what_it_decided(tiny_gguf, machine):
    with_draft = decide(RunConfig.from_options(**OPTION_SETS["draft"](str(tiny_gguf))), machine)
    assert with_draft.draft.kind is DraftKind.MODEL and with_draft.draft.store == with_draft.target
    assert with_draft.budget == 600 << 20 and with_draft.tree.width == 6 and not with_draft.budget_auto
    alone = decide(RunConfig.from_options(**OPTION_SETS["auto"](str(tiny_gguf))), machine)
    assert alone.draft.kind is DraftKind.TRIE and alone.budget_auto and alone.budget == alone.memory.budget
    assert any("n-gram trie" in n for n in alone.notes)  # the choice made for the user, in one line
    assert alone.options()["draft"] == "none" and alone.options()["context"] == 256
    target = decide(RunConfig.from_options(target=str(tiny_gguf), mode="target"), machine)
    assert target.draft.kind is DraftKind.NONE and not target.speculative
    assert target.with_mode(Mode.STDPL).mode is Mode.STDPL


def test_a_budget_too_small_is_refused_with_what_was_decided(tiny_gguf, machine):
    cfg = RunConfig.from_options(target=str(tiny_gguf), draft=str(tiny_gguf), memory_budget="100MiB")
    with pytest.raises(BudgetRefused, match="too small") as e:
        decide(cfg, machine)
    assert e.value.plan.draft.kind is DraftKind.MODEL and e.value.plan.memory is None


@pytest.mark.parametrize("command", ["run", "chat", "serve", "bench", "plan"])
@pytest.mark.parametrize("name", list(OPTION_SETS))
def test_every_front_door_reaches_the_same_plan(tiny_gguf, machine, command, name):
    """Each command's flags become the configuration `decide` gets: the same plan as `cadence.LLM(**options)`
    (chat and serve are an LLM behind a terminal or HTTP: their plans keep room for sampled requests) or as
    the options given to the engine directly (run, bench, plan)."""
    opts = OPTION_SETS[name](str(tiny_gguf))
    args = build_parser(command).parse_args([command, *argv(opts)])
    cfg = door_config(args) if command == "plan" else run_config(args)  # plan: `--for run`'s configuration
    if command == "serve":  # its own default: as many slots as the memory allows
        opts = {"parallel": 0, **opts}
    if command in ("chat", "serve"):
        assert decide(config_of(cfg), machine) == decide(config_of(RunConfig.from_options(**opts)), machine)
    else:
        assert decide(cfg, machine) == decide(RunConfig.from_options(**opts), machine)


def test_launch_plan_and_launch_run_decide_alike(tiny_gguf, tmp_path):
    """The plan `launch plan` prints is the one `launch run` runs: the same draft, budget and groups resident."""
    opts = ["--target", str(tiny_gguf), "--draft", str(tiny_gguf), "--memory-budget", "600MiB", "--context", "512"]
    printed = launch("plan", *opts, home=tmp_path, check=True).stdout
    out = tmp_path / "rows.json"
    launch(
        "run", *opts, "--prompt", "a b c", "--max-new-tokens", "4", "--no-monitor", "--json", str(out), home=tmp_path
    )
    row = json.loads(out.read_text())[0]
    assert f"tree {tiny_gguf} int4, draft {tiny_gguf} int4; f16 KV caches for a context of 512 tokens" in printed
    assert "of 600 MiB budget" in printed and "resident: layer 0-1; head 0" in printed
    assert row["memory_budget_bytes"] == 600 << 20 and row["draft"] == str(tiny_gguf)
    assert row["memory_plan"]["resident_groups"] == 3 and row["memory_plan"]["streamed_groups"] == 0


def test_parallel_slots_each_have_their_kv_caches_in_the_plan(tiny_gguf, machine):
    """`--parallel N`: each slot's KV caches (the target's and the draft's) are in the memory plan, a budget's
    default context is shared out among the slots, and `launch plan` says how many slots at what context."""
    base = dict(target=str(tiny_gguf), draft=str(tiny_gguf), memory_budget="auto", max_new_tokens=8, width=6)
    one = decide(RunConfig.from_options(**base, context=256), machine)
    four = decide(RunConfig.from_options(**base, context=256, parallel=4), machine)
    from engine.memory import batch_width, kv_rows
    from speculative.batch import WIDEST

    assert four.parallel == 4 and four.memory.target_kv == 4 * four.target.args.kv_bytes(kv_rows(four), "f16")
    assert four.memory.target_kv > 4 * one.memory.target_kv > 0  # each slot's room for the widest tree it may get
    assert four.memory.draft_kv > 4 * one.memory.draft_kv
    # a slot's tree may take the others' rows (at most WIDEST); the draft runs on up to twice a tree's nodes
    # (speculative/bestfirst.py), the target verifies the tree, its root and the bonus token; the draft sees the
    # prompt's last 64 tokens and the new ones
    w = min(WIDEST, batch_width(four))
    assert kv_rows(four) == four.context + w + 2 and kv_rows(four, draft=True) == 64 + 8 + 2 * w + 2
    shared = decide(RunConfig.from_options(**base, parallel=4), machine)
    assert shared.context == min(shared.target.args.context_length, 512)  # 2048 rows a budget's default, shared
    assert f"4 slots (--parallel) sharing an f16 KV pool of 4 x {shared.context} tokens" in shared.headline()
    with pytest.raises(Exception, match="--parallel -1 must be at least 1"):
        RunConfig.from_options(**base, parallel=-1)


def test_parallel_0_takes_as_many_slots_as_the_budget_holds_with_the_draft(tiny_gguf, machine):
    """`--parallel 0` (launch serve's default): four slots where the budget holds them with the draft; a budget
    that holds the draft with one slot but not four gets fewer; resident, four."""
    base = dict(target=str(tiny_gguf), draft=str(tiny_gguf), max_new_tokens=8, width=6, context=512)
    smallest = {
        n: decide(RunConfig.from_options(**base, memory_budget="auto", parallel=n), machine).memory.smallest
        for n in (1, 2, 4)
    }
    assert smallest[1] < smallest[2] < smallest[4]
    for budget, slots in ((smallest[4], 4), (smallest[4] - 1, 2), (smallest[2] - 1, 1)):
        plan = decide(RunConfig.from_options(**base, memory_budget=str(budget), parallel=0), machine)
        assert plan.parallel == slots and plan.draft.model, budget
        assert plan.notes[0].startswith(f"slots: {slots} (--parallel 0: the most of 4 the budget holds with the draft")
        assert plan.asked.parallel == 0
    assert decide(RunConfig.from_options(**base, parallel=0), machine).parallel == 4
    flash = decide(RunConfig.from_options(**base, parallel=0, mode="flash"), machine)
    assert flash.parallel == 1 and "mode flash generates one prompt at a time" in flash.notes[0]


def test_parallel_0_shortens_each_slots_share_to_keep_the_draft(tiny_gguf, machine, monkeypatch):
    """`launch serve`'s default with no context asked for: where several slots at their share of the default
    context would drop the draft, a shorter share (down to SLOT_CONTEXT) that keeps it is taken; a context the
    user asked for is kept, and then the budget holds one slot."""
    import engine.memory

    monkeypatch.setattr(engine.memory, "SLOT_CONTEXT", 128)  # the tiny model holds 512 tokens in all
    monkeypatch.setattr(engine.memory, "SLOT_STEP", 64)
    base = dict(target=str(tiny_gguf), draft=str(tiny_gguf), width=6)
    smallest = lambda n, context: (
        decide(  # noqa: E731
            RunConfig.from_options(**base, memory_budget="auto", parallel=n, context=context), machine
        ).memory.smallest
    )
    budget = smallest(2, 256)
    assert smallest(2, 512) > budget and smallest(4, 512) > budget  # the default shares drop the draft
    plan = decide(RunConfig.from_options(**base, memory_budget=str(budget), parallel=0), machine)
    assert plan.parallel > 1 and plan.draft.model and 128 <= plan.context < 512
    assert plan.memory.total <= budget
    assert f"each holds {plan.context} (its share of the default context, 512, would drop the draft)" in plan.notes[0]
    asked = decide(RunConfig.from_options(**base, memory_budget=str(budget), parallel=0, context=512), machine)
    assert asked.parallel == 1 and asked.context == 512 and asked.draft.model


@pytest.mark.real
def test_parallel_n_that_leaves_no_room_for_the_draft_says_how_many_slots_keep_it(machine):
    """`--parallel N` given by hand, under a budget that holds the picked draft beside one slot but not beside N:
    the plan drops the draft (each generation on the n-gram trie alone) and says which fewer slots keep it."""
    base = dict(target="qwen2.5-coder-1.5b", context=256, max_new_tokens=64)
    from engine.budget_choice import LEAN_FORMAT, LEAN_VOCAB

    lean = dict(draft_dtype=LEAN_FORMAT, draft_vocab=LEAN_VOCAB)  # the leanest draft the plan would go to
    budget = str(decide(RunConfig.from_options(**base, **lean, memory_budget="auto"), machine).memory.smallest)
    one = decide(RunConfig.from_options(**base, memory_budget=budget, parallel=1), machine)
    assert one.draft.model  # the least that holds one slot with the draft
    four = decide(RunConfig.from_options(**base, memory_budget=budget, parallel=4), machine)
    assert four.parallel == 4 and not four.draft.model
    (line,) = [n for n in four.notes if n.startswith("slots: 4 leave no room for the draft model")]
    kept = int(line.split("--parallel ")[1].split()[0])
    assert (
        1 <= kept < 4
        and decide(RunConfig.from_options(**base, memory_budget=budget, parallel=kept), machine).draft.model
    )
    assert not any(n.startswith("slots:") for n in one.notes)


@pytest.mark.real
def test_a_budget_that_holds_the_lean_draft_only_with_its_caches_in_q8_keeps_it_so(machine):
    """Eight slots under a budget that holds the leanest draft (int2, its head cut) only with its own KV caches in
    q8: given so by hand, the plan holds it, the target's caches stay f16 (the text is the target's) and the
    draft's caches are counted at q8; `--draft auto` reaches the same draft down its leaner-draft ladder and says so
    in one line, then keeps it where this machine's measured costs and acceptance say it pays (engine/costs.py,
    engine/acceptance.py: measured here, so either way) and else drops it for its reads, not for its room; with
    `--draft-kv-dtype f16` given, the same budget has no room for the draft."""
    from engine.budget_choice import LEAN_FORMAT, LEAN_KV, LEAN_VOCAB
    from engine.memory import kv_rows

    base = dict(target="qwen2.5-coder-1.5b", parallel=8, context=512)
    name = machine.pick_draft("qwen2.5-coder-1.5b")[0]
    lean = dict(base, draft=name, draft_dtype=LEAN_FORMAT, draft_vocab=LEAN_VOCAB, memory_budget="auto")
    q8 = decide(RunConfig.from_options(**lean, draft_kv_dtype=LEAN_KV), machine).memory.smallest
    assert q8 < decide(RunConfig.from_options(**lean), machine).memory.smallest
    given = decide(RunConfig.from_options(**lean | dict(memory_budget=str(q8), draft_kv_dtype=LEAN_KV)), machine)
    assert given.draft.model and given.draft.kv_dtype == LEAN_KV and given.kv_dtype == "f16"
    assert given.memory.draft_kv == 8 * given.draft.store.args.kv_bytes(kv_rows(given, draft=True), LEAN_KV)
    assert "(its KV in q8)" in given.headline()
    plan = decide(RunConfig.from_options(**base, memory_budget=str(q8)), machine)
    ladder, *dropped = [n for n in plan.notes if n.startswith("draft: ")]
    assert ladder.startswith(f"draft: {name} {LEAN_FORMAT} (") and "its KV caches in q8" in ladder
    assert "--draft-kv-dtype D" in ladder
    if plan.draft.model:
        assert not dropped and (plan.draft.store, plan.draft.kv_dtype, plan.kv_dtype) == (
            given.draft.store,
            "q8",
            "f16",
        )
        assert plan.memory.draft_kv == given.memory.draft_kv and "(its KV in q8)" in plan.headline()
    else:
        (why,) = dropped
        assert why.startswith("draft: none (under") and "would push" in why
    f16 = decide(RunConfig.from_options(**base, memory_budget=str(q8), draft_kv_dtype="f16"), machine)
    assert not f16.draft.model
    (room,) = [n for n in f16.notes if n.startswith("draft: ")]
    assert room.startswith(f"draft: none (with the draft {name}, even in {LEAN_FORMAT}")


def test_a_plan_that_may_match_grammars_counts_their_vocabulary(tiny_gguf, machine):
    """A grammar given, or requests that may send one (a server's, `cadence.LLM`'s): the plan counts the grammar's
    view of the vocabulary as measured, once for the model actors (the zygote makes it before they fork: its
    preload says so) and once more for a scheduler whose trie drafts alone."""
    from speculative.grammar import PRELOAD, vocabulary_bytes
    from scheduler.generation.memplan import align

    base = OPTION_SETS["draft"](str(tiny_gguf))
    grammar = 'start: "a" | "b"'
    plans = {
        "plain": decide(RunConfig.from_options(**base), machine),
        "given": decide(RunConfig.from_options(**base, grammar=grammar), machine),
        "served": decide(config_of(RunConfig.from_options(**base)), machine),
        "trie": decide(RunConfig.from_options(**base | {"draft": "none"}, grammar=grammar), machine),
    }
    target = plans["plain"].target
    one = align(vocabulary_bytes(str(target.dir), target.args.vocab_size))
    held = {k: p.memory.overheads.grammar for k, p in plans.items()}
    assert held == {"plain": 0, "given": one, "served": one, "trie": 2 * one} and one > 0
    entry = f"{PRELOAD}{target.dir}:{target.args.vocab_size}"
    assert entry in plans["given"].scheduler.preload and entry not in plans["plain"].scheduler.preload
    assert "grammars' view of the vocabulary" in plans["given"].memory.report()
    assert "grammars' view" not in plans["plain"].memory.report()
