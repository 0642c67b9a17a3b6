"""The memory plan: what stays, what streams, and the sentence for a budget too small."""
import pytest

from cadence.errors import CadenceError
from scheduler.memplan import Overheads, plan_memory, parse_bytes

MiB = 1 << 20
LAYERS = {f"layer.{i}": 27 * MiB for i in range(28)}
GROUPS = {**LAYERS, "head": 135 * MiB}
O = Overheads(model_process=100 * MiB, scheduler=50 * MiB, loader=20 * MiB, activations=10 * MiB, exchange=8 * MiB)


def test_everything_resident_when_it_fits():
    p = plan_memory(8 << 30, GROUPS, 300 * MiB, 30 * MiB, 60 * MiB, O)
    assert p.streamed == () and p.n_slots == 0 and p.total <= p.budget


def test_half_budget_keeps_the_head_and_first_layers_and_streams_the_rest():
    p = plan_memory(1200 * MiB, GROUPS, 300 * MiB, 30 * MiB, 60 * MiB, O)
    assert p.resident[0] == "layer.0" and "head" in p.resident
    assert p.streamed == tuple(f"layer.{i}" for i in range(len(p.resident) - 1, 28))
    assert p.slot_bytes == 27 * MiB and p.n_slots in (2, 3)
    assert p.total <= p.budget
    assert p.fixed + p.resident_bytes + 2 * p.slot_bytes <= p.budget


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
