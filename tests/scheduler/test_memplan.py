"""The memory plan: what stays, what streams, and the sentence for a budget too small."""
import pytest

from cadence.errors import CadenceError
from scheduler.memplan import Overheads, plan_memory, parse_bytes

MiB = 1 << 20
LAYERS = {f"layer.{i}": 27 * MiB for i in range(28)}
GROUPS = {**LAYERS, "head": 135 * MiB}
O = Overheads(scheduler=50 * MiB, runtime=100 * MiB, actor=10 * MiB, loader=20 * MiB, watchdog=8 * MiB, exchange=8 * MiB,
              verifier_activations=10 * MiB, draft_activations=10 * MiB)


def test_everything_resident_when_it_fits():
    p = plan_memory(8 << 30, GROUPS, 300 * MiB, 30 * MiB, 60 * MiB, O)
    assert p.streamed == () and p.n_slots == 0 and p.total <= p.budget


def test_half_budget_keeps_the_head_and_spreads_the_resident_layers_between_the_streamed():
    p = plan_memory(1200 * MiB, GROUPS, 300 * MiB, 30 * MiB, 60 * MiB, O)
    assert "head" in p.resident and set(p.resident) | set(p.streamed) == set(GROUPS)
    assert p.slot_bytes == 27 * MiB and p.n_slots in (2, 3)
    assert p.total <= p.budget
    assert p.fixed + p.resident_bytes + 2 * p.slot_bytes <= p.budget
    # a forward starts on a streamed layer (the slot it frees lets the loader start at once), and no two
    # resident layers are more than one apart beyond what the counts force: the loader reads while they compute
    layers = [int(n.split(".")[1]) for n in p.streamed]
    assert layers[0] == 0 and layers == sorted(layers)
    gaps = [b - a - 1 for a, b in zip(layers, layers[1:] + [28])]
    assert max(gaps) - min(gaps) <= 1, gaps
    kept = 28 - len(layers)
    assert sum(gaps) == kept and 0 < kept < 28


def test_the_spread_keeps_as_many_layers_as_fit():
    for budget in (1000, 1200, 1400):
        p = plan_memory(budget * MiB, GROUPS, 300 * MiB, 30 * MiB, 60 * MiB, O)
        assert p.streamed and p.total <= p.budget
        assert p.fixed + p.resident_bytes + 27 * MiB + 2 * p.slot_bytes > p.budget  # one more layer would not fit


def test_budget_too_small_names_the_shortfall_and_the_smallest_that_works():
    with pytest.raises(CadenceError) as e:
        plan_memory(500 * MiB, GROUPS, 300 * MiB, 30 * MiB, 60 * MiB, O)
    msg = str(e.value)
    assert "too small" in msg and "draft (300 MiB)" in msg and "two streaming slots" in msg
    smallest = msg.rsplit("works is ", 1)[1]
    budget = parse_bytes(smallest.replace(" ", ""))
    p = plan_memory(budget + MiB, GROUPS, 300 * MiB, 30 * MiB, 60 * MiB, O)  # that budget does work
    assert p.n_slots >= 2


@pytest.mark.parametrize("text,n", [("3GiB", 3 << 30), ("800MiB", 800 << 20), ("2.5G", int(2.5 * 2**30)), ("1000", 1000)])
def test_parse_bytes(text, n):
    assert parse_bytes(text) == n


def test_parse_bytes_refuses_nonsense():
    with pytest.raises(CadenceError, match="3GiB"):
        parse_bytes("lots")
