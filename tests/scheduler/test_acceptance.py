"""engine/acceptance.py: what this machine's tree runs measured each draft to give, kept across runs, and the plan
under a budget priced with it (issue 56 item 4: choices from what is measured, not from a rule a measurement
contradicts). The suite plans without these records (tests/conftest.py: CADENCE_LEARN=0); these tests turn them on."""

from __future__ import annotations

import pytest

from common import paths
from engine import acceptance
from engine.acceptance import KEEP, MIN_VERIFICATIONS, TOKENS_PER_VERIFICATION, Acceptance

PAIR = ("/stores/target", "/stores/draft", 0)


@pytest.fixture
def learning(tmp_path, monkeypatch):
    monkeypatch.setenv("CADENCE_LEARN", "1")
    monkeypatch.setenv("CADENCE_HOME", str(tmp_path / "home"))


def test_a_runs_figures_add_to_what_was_kept_and_the_older_weigh_less(learning):
    k = acceptance.key(*PAIR)
    assert acceptance.read(k) == Acceptance()  # nothing kept yet
    stats = {"verifications": 80, "accepted": 130, "plain_steps": 20, "drafted": 1280, "draft_forwards": 640}
    run = Acceptance().add({**stats, "forced": 10}, 210)  # ten tokens a grammar forced: not the draft's
    assert (run.verifications, run.accepted, run.forwards, run.tokens) == (80, 120, 100, 200)
    assert run.shape() == (17, 8)  # trees of 16 draft tokens and their root, 8 draft forwards each
    kept = acceptance.record(k, run)
    assert acceptance.read(k) == kept and kept.runs == 1 and kept.updated
    assert not kept.speaks  # 80 verifications: too few to speak for the pair
    got = acceptance.expected(*PAIR)
    assert (got.gives, got.alone_gives, got.shape) == (TOKENS_PER_VERIFICATION, 1.0, None)  # the rule, the width's
    kept = acceptance.record(k, run)
    assert kept.speaks and kept.verifications == 160 >= MIN_VERIFICATIONS and kept.runs == 2
    assert kept.per_verification() == 1 + 120 / 80 and kept.per_forward() == 200 / 100
    got = acceptance.expected(*PAIR)
    assert (got.gives, got.alone_gives, got.shape) == (2.5, 1.0, (17, 8))  # the trie alone: nothing measured
    assert got.said.startswith(
        "acceptance: the draft 2.50 tokens a verification of 17 rows after 8.0 draft forwards, measured over 160 "
        "verifications of 2 runs here"
    )
    assert acceptance.record(k, run, ended=False).runs == 2  # a server's figures as it goes: not a run's end
    # a long history: its worth held at KEEP forwards, a new run's figures weighing as much as they measure
    acceptance.record(k, Acceptance(10 * KEEP, 10 * KEEP, 10 * KEEP, 20 * KEEP))
    weak = acceptance.record(k, Acceptance(KEEP, 0, KEEP, KEEP))
    assert weak.forwards == pytest.approx(KEEP) and weak.verifications == pytest.approx(KEEP, rel=1e-2)
    assert 1.4 < weak.per_verification() < 1.6  # half the worth is the weak run's: 1 + (1 + 0) / 2


def test_the_trie_alone_and_each_draft_are_pairs_of_their_own(learning):
    acceptance.record(acceptance.key("/t", None, 0), Acceptance(0, 0, 200, 300))  # plain steps and trie guesses
    acceptance.record(acceptance.key("/t", "/d-int4", 32768), Acceptance(200, 800, 200, 1000, 1600, 800))
    got = acceptance.expected("/t", "/d-int4", 32768)
    assert (got.gives, got.alone_gives, got.shape) == (5.0, 1.5, (9, 4))
    assert acceptance.expected("/t", "/d-int2", 32768).gives == TOKENS_PER_VERIFICATION  # int2: not measured
    assert acceptance.expected("/t", "/d-int4", 0).gives == TOKENS_PER_VERIFICATION  # another head: another pair


def test_a_draft_the_trie_alone_has_long_run_past_is_priced_by_the_rule_to_be_measured_again(learning):
    """A draft measured to give 1.2 tokens a verification, then RETRY forwards of the trie alone since (the plans
    that dropped the draft on its record never measure it again; the workload may have changed): priced by the rule
    once more, said; a run with the draft after that makes its record speak again."""
    from engine.acceptance import RETRY

    draft, alone = acceptance.key("/t", "/d", 0), acceptance.key("/t", None, 0)
    acceptance.record(alone, Acceptance(0, 0, 100, 100))
    acceptance.record(draft, Acceptance(200, 40, 200, 240), alone=alone)
    assert acceptance.read(draft).alone_at == 100 and acceptance.read(alone).total == 100
    got = acceptance.expected("/t", "/d", 0)
    assert (got.gives, got.stale) == (1.2, False)
    acceptance.record(alone, Acceptance(0, 0, RETRY - 1, RETRY - 1))  # a forward short
    assert acceptance.expected("/t", "/d", 0).gives == 1.2
    acceptance.record(alone, Acceptance(0, 0, 1, 1))
    assert acceptance.read(alone).total == RETRY + 100 and acceptance.read(alone).forwards == pytest.approx(KEEP)
    got = acceptance.expected("/t", "/d", 0)
    assert (got.gives, got.shape, got.stale) == (TOKENS_PER_VERIFICATION, None, True)
    assert f"before the trie alone ran {RETRY} forwards here: to be measured again, priced as assumed" in got.said
    acceptance.record(draft, Acceptance(200, 500, 200, 700), alone=alone)  # measured afresh: the old figures go
    got = acceptance.expected("/t", "/d", 0)
    assert not got.stale and got.gives == pytest.approx(1 + 500 / 200) and acceptance.read(draft).runs == 2
    # a strong draft's record gone stale keeps its figure: staleness only makes a plan likelier to run the draft
    acceptance.record(alone, Acceptance(0, 0, RETRY, RETRY))
    got = acceptance.expected("/t", "/d", 0)
    assert got.stale and got.gives == pytest.approx(3.5) and got.shape is None  # no tree counted: the width's


def test_without_learning_nothing_is_kept_or_read(learning, monkeypatch):
    k = acceptance.key(*PAIR)
    acceptance.record(k, Acceptance(200, 100, 200, 300))
    monkeypatch.setenv("CADENCE_LEARN", "0")
    assert acceptance.read(k) == Acceptance()
    acceptance.record(k, Acceptance(200, 0, 200, 200))
    monkeypatch.setenv("CADENCE_LEARN", "1")
    assert acceptance.read(k).runs == 1  # the second run kept nothing


def test_a_record_that_cannot_be_read_is_none_and_figures_out_of_range_price_nothing(learning):
    k = acceptance.key(*PAIR)
    acceptance.record(k, Acceptance(200, 100, 200, 300))
    path = paths.home() / "calibration" / f"accept-{k}.json"
    for damaged in ('{"verifications": 200, "accepted"', '{"verifications": "many"}', '{"tokens_per_s": 3}', "[]"):
        path.write_text(damaged)
        assert acceptance.read(k) == Acceptance(), damaged
    assert acceptance.record(k, Acceptance(200, 100, 200, 300)).runs == 1  # written afresh
    # figures no run makes (negative, or no tokens at all): one token a forward at the least, none accepted
    bad = Acceptance(200, -500, 200, 0, -3, -1)
    assert bad.per_verification() == 1.0 and bad.per_forward() == 1.0 and bad.shape() is None


@pytest.fixture
def kept_apart(tmp_path, monkeypatch):
    """Records in a folder of their own, the models and costs in the session's home."""
    monkeypatch.setenv("CADENCE_LEARN", "1")
    monkeypatch.setattr(acceptance, "_path", lambda k: tmp_path / f"accept-{k}.json")


@pytest.mark.real
def test_a_real_tree_run_keeps_what_it_measured(kept_apart):
    """The default pair, resident, two prompts: the record of the pair is the sum of the generations' figures."""
    from engine.config import RunConfig
    from engine.prompts import Prompt
    from engine.runner import Runner
    from tests.conftest import dev_prompts

    prompts = [Prompt(p["id"], p["kind"], p["prompt"]) for p in dev_prompts() if p["id"] in ("fib", "explain")]
    cfg = RunConfig.from_options(runtime="inproc", mode="tree", max_new_tokens=24, chat="off", no_trace=True)
    with Runner(cfg) as runner:
        done = [runner.run(p) for p in prompts]
        k = acceptance.of_plan(runner.plan)
        assert acceptance.read(k) == Acceptance()  # kept as the run closes
    kept = acceptance.read(k)
    assert k == acceptance.key(runner.plan.target.dir, runner.plan.draft.store.dir, runner.plan.draft.head_rows)
    assert kept.runs == 1 and kept.verifications == sum(c.stats["verifications"] for c in done) > 0
    assert kept.accepted == sum(c.stats["accepted"] for c in done) > 0
    steps = sum(c.stats["verifications"] + c.stats["plain_steps"] for c in done)
    assert kept.forwards == steps and kept.tokens == sum(len(c.token_ids) - 1 for c in done)
    assert kept.drafted == sum(c.stats["drafted"] for c in done) > 0
    assert kept.draft_forwards == sum(c.stats["draft_forwards"] for c in done) > 0


@pytest.fixture
def home_records(tmp_path, monkeypatch):
    """A home of its own for the records `launch plan` reads in a process of its own: the session home's stores,
    models and measurements linked in, none of its records."""
    real, home = paths.home(), tmp_path / "home"
    (home / "calibration").mkdir(parents=True)
    for f in real.iterdir():
        if f.name != "calibration":
            (home / f.name).symlink_to(f)
    for f in (real / "calibration").iterdir():
        if not f.name.startswith("accept-"):
            (home / "calibration" / f.name).symlink_to(f)
    monkeypatch.setenv("CADENCE_LEARN", "1")
    monkeypatch.setenv("CADENCE_HOME", str(home))
    return home


@pytest.mark.real
def test_a_budgeted_plan_prices_the_draft_with_what_runs_measured(home_records):
    """At 768 MiB `launch plan` keeps the default pair's int4 draft on the rule of thumb (2.5 tokens a
    verification); where this machine's runs measured it to give 1.2, the same command plans the trie alone and
    says why in figures."""
    from engine.machine import ThisMachine
    from engine.memory import DRAFT_VOCAB
    from tests.launch.conftest import launch

    plan = ["plan", "--memory-budget", "768MiB", "--max-new-tokens", "64"]
    first = launch(*plan, home=home_records, check=True).stdout
    assert "draft qwen2.5-coder-0.5b int4;" in first, first
    assert "acceptance: the draft 2.5 tokens a verification (assumed" in first, first
    machine = ThisMachine(lambda s: None)
    target, draft = (machine.store(name, "int4").dir for name in ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"))
    acceptance.record(acceptance.key(target, draft, DRAFT_VOCAB), Acceptance(200, 40, 200, 240))
    second = launch(*plan, home=home_records, check=True).stdout
    assert "no draft model" in second, second
    (line,) = [n for n in second.splitlines() if n.startswith("draft: none")]
    assert "than its 1.20 tokens a verification save here" in line, line
    assert "the draft 1.20 tokens a verification, measured over 200 verifications of 1 run here" in second, second
    alone = acceptance.key(target, None, 0)  # the trie alone's runs since: the draft is priced by the rule again
    acceptance.record(alone, Acceptance(0, 0, acceptance.RETRY, acceptance.RETRY))
    third = launch(*plan, home=home_records, check=True).stdout
    assert "draft qwen2.5-coder-0.5b int4;" in third and "to be measured again" in third, third
