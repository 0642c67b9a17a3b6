"""The memory plan: what stays, what streams, and the sentence for a budget too small."""

import os

import pytest

from common.errors import CadenceError
from common.units import fmt, fmt_up, parse_bytes
from scheduler.generation.footprint import activation_bytes
from scheduler.generation.memplan import Overheads, plan_memory

MiB = 1 << 20
LAYERS = {f"layer.{i}": 27 * MiB for i in range(28)}
HEAD = {f"head.{j}": 27 * MiB for j in range(4)} | {"head.4": 21 * MiB}  # the head in parts of about a layer
GROUPS = {**LAYERS, **HEAD}
O = Overheads(
    scheduler=50 * MiB,
    runtime=100 * MiB,
    actor=10 * MiB,
    watchdog=8 * MiB,
    exchange=8 * MiB,
    verifier_activations=10 * MiB,
    draft_activations=10 * MiB,
    code=20 * MiB,
)


def test_everything_resident_when_it_fits():
    p = plan_memory(8 << 30, GROUPS, 300 * MiB, 30 * MiB, 60 * MiB, O)
    assert p.streamed == () and p.n_slots == 0 and p.total <= p.budget and p.read_per_forward == 0


def test_half_budget_spreads_the_resident_groups_between_the_streamed():
    p = plan_memory(1200 * MiB, GROUPS, 300 * MiB, 30 * MiB, 60 * MiB, O)
    assert set(p.resident) | set(p.streamed) == set(GROUPS) and not set(p.resident) & set(p.streamed)
    assert p.slot_bytes == 27 * MiB and p.n_slots in (2, 3)
    assert p.total <= p.budget
    assert p.fixed + p.resident_bytes + 2 * p.slot_bytes <= p.budget
    assert p.read_per_forward == sum(GROUPS[g] for g in p.streamed)
    # a forward starts on a streamed group (the slot it frees lets the loader start at once), and no two
    # resident groups are more than one apart beyond what the counts force: the loader reads while they compute
    order = list(GROUPS)
    streamed = [order.index(n) for n in p.streamed]
    assert streamed[0] == 0 and streamed == sorted(streamed)
    gaps = [b - a - 1 for a, b in zip(streamed, streamed[1:] + [len(order)])]
    assert max(gaps) - min(gaps) <= 1, gaps
    kept = len(order) - len(streamed)
    assert sum(gaps) == kept and 0 < kept < len(order)


def test_the_plan_keeps_as_many_groups_as_fit():
    for budget in (800, 1000, 1200, 1400):
        p = plan_memory(budget * MiB, GROUPS, 300 * MiB, 30 * MiB, 60 * MiB, O)
        assert p.streamed and p.total <= p.budget
        assert p.fixed + p.resident_bytes + 27 * MiB + 2 * p.slot_bytes > p.budget  # one more group would not fit


def test_the_head_streams_in_parts_so_a_small_budget_needs_only_layer_sized_slots():
    p = plan_memory(700 * MiB, GROUPS, 300 * MiB, 30 * MiB, 60 * MiB, O)
    assert p.slot_bytes == 27 * MiB and any(g.startswith("head.") for g in p.streamed)


def test_a_run_without_a_draft_plans_no_draft_actor():
    with_draft = plan_memory(1000 * MiB, GROUPS, 300 * MiB, 30 * MiB, 60 * MiB, O)
    without = plan_memory(1000 * MiB, GROUPS, 0, 0, 60 * MiB, O)
    assert not without.has_draft and without.resident_bytes > with_draft.resident_bytes
    assert without.fixed == with_draft.fixed - 300 * MiB - 30 * MiB - O.actor - O.draft_activations


def test_held_is_the_total_less_the_code_pages():
    p = plan_memory(1000 * MiB, GROUPS, 300 * MiB, 30 * MiB, 60 * MiB, O)
    assert p.held == p.total - O.code
    assert "code pages" in p.report() and "streamed through" in p.summary()


def test_budget_too_small_names_the_shortfall_and_the_smallest_that_works():
    with pytest.raises(CadenceError) as e:
        plan_memory(500 * MiB, GROUPS, 300 * MiB, 30 * MiB, 60 * MiB, O)
    msg = str(e.value)
    assert "too small" in msg and "draft (300 MiB)" in msg and "two streaming slots" in msg
    smallest = msg.rsplit("works is ", 1)[1]
    budget = parse_bytes(smallest.replace(" ", ""))
    p = plan_memory(budget, GROUPS, 300 * MiB, 30 * MiB, 60 * MiB, O)  # that budget works as typed ...
    assert p.n_slots >= 2
    with pytest.raises(CadenceError, match="too small"):  # ... and is the smallest in whole MiB
        plan_memory(budget - MiB, GROUPS, 300 * MiB, 30 * MiB, 60 * MiB, O)


def test_a_size_named_as_a_smallest_budget_rounds_up():
    assert (fmt_up(676 * MiB), fmt_up(676 * MiB + 1), fmt(676 * MiB + 1)) == ("676 MiB", "677 MiB", "676 MiB")
    assert (fmt_up(3 << 29), fmt_up((3 << 29) + 1), fmt_up(2**30 - 1)) == ("1.50 GiB", "1.51 GiB", "1024 MiB")


def test_activations_grow_with_the_rows_and_sampling_keeps_probabilities():
    a = {"dim": 1536, "ffn_dim": 8960, "n_heads": 12, "n_kv_heads": 2, "head_dim": 128, "vocab_size": 151936}
    assert activation_bytes(a, 8, 9) < activation_bytes(a, 256, 9)  # a long prompt's prefill chunk
    assert activation_bytes(a, 1, 9) < activation_bytes(a, 1, 17)
    assert activation_bytes(a, 1, 9, greedy=True) < activation_bytes(a, 1, 9, greedy=False)
    assert activation_bytes(a, 1, 9, head_rows=32768) < activation_bytes(a, 1, 9)
    # a greedy verification holds one head part's logits at a time (models.sampling.HeadArgmax): a wide tree
    # costs a fraction of the whole rows' logits; sampling keeps every row's distribution whatever the parts
    part = 30464  # the 1.5B's head parts
    assert activation_bytes(a, 1, 17, head_part=part) < activation_bytes(a, 1, 17) / 4
    assert activation_bytes(a, 1, 17, head_part=part) < activation_bytes(a, 1, 9)
    assert activation_bytes(a, 1, 17, greedy=False, head_part=part) == activation_bytes(a, 1, 17, greedy=False)


@pytest.mark.parametrize(
    "text,n",
    [
        ("3GiB", 3 << 30),
        ("800MiB", 800 << 20),
        ("2.5G", int(2.5 * 2**30)),
        ("1000", 1000),
        ("1000B", 1000),
        ("64k", 64 << 10),
        ("64K", 64 << 10),
        ("64KiB", 64 << 10),
        ("64kb", 64_000),
        ("2MB", 2_000_000),
        ("2m", 2 << 20),
        ("1gb", 10**9),
        ("1 GiB", 1 << 30),
        ("0.5 mib", 1 << 19),
    ],
)
def test_parse_bytes(text, n):
    assert parse_bytes(text) == n


@pytest.mark.parametrize("unit,n", [("TiB", 1 << 40), ("TB", 10**12), ("T", 1 << 40), ("tib", 1 << 40)])
def test_parse_bytes_reads_terabytes_and_refuses_more_than_the_machine_has(unit, n):
    """Issue 24: TiB was refused while 999999GiB was taken."""
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    small = have / n / 2  # half this machine's memory, in the unit
    assert parse_bytes(f"{small}{unit}") == int(small * n)
    for big in (f"{2 * have / n}{unit}", "999999GiB", "1e400GiB"):
        with pytest.raises(CadenceError) as e:
            parse_bytes(big)
        assert f"is more than this machine's memory ({have / 2**30:.2f} GiB)" in str(e.value)
        assert "leave --memory-budget out to run without a bound" in str(e.value)


@pytest.mark.parametrize("text", ["lots", "3 PB", "-3GiB", "infGiB", "12x", "", "1.2.3G"])
def test_parse_bytes_refuses_nonsense(text):
    with pytest.raises(CadenceError, match="3GiB"):
        parse_bytes(text)


def test_parse_bytes_refuses_nothing():
    with pytest.raises(CadenceError, match="not above zero"):
        parse_bytes("0.1")
