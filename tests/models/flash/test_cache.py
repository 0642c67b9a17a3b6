"""flash/cache.py: the preallocated matrix with swap-delete keeps exactly the window's neurons. Random
sequences of steps (admit + insert) and of bare touch / evict / make_room are checked, after every operation,
against a plain Python model of the window: a dict of neuron -> last active step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common.errors import CadenceError
from flash.cache import NeuronCache

R = 40  # bytes per record here: the cache does not read them


def _records(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n, R), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _consistent(c: NeuronCache, model: dict[int, int], table: torch.Tensor) -> None:
    used = c.ids[: c.num_used]
    assert c.num_used == len(model) <= c.capacity
    assert sorted(used.tolist()) == sorted(model)
    assert (c.ids[c.num_used :] == -1).all()
    assert (c.slot_of[used] == np.arange(c.num_used)).all()
    absent = np.setdiff1d(np.arange(c.n_neurons), used)
    assert (c.slot_of[absent] == -1).all()
    assert [int(c.last_active[s]) for s in range(c.num_used)] == [model[int(i)] for i in used]
    assert torch.equal(c.matrix[: c.num_used], table[torch.from_numpy(used.astype(np.int64))])


def _model_make_room(model: dict[int, int], cap: int, k: int, step: int) -> bool:
    """The window under a fixed capacity: least recently active first, ties by lower id. False: impossible."""
    need = k - (cap - len(model))
    if need <= 0:
        return True
    order = sorted(model, key=lambda i: (model[i], i))[:need]
    if k > cap or any(model[i] >= step for i in order):
        return False
    for i in order:
        del model[i]
    return True


def _model_evict(model: dict[int, int], step: int, window: int) -> None:
    for i in [i for i, last in model.items() if last <= step - window]:
        del model[i]


def _active(rng, prev: np.ndarray, n: int, k: int) -> np.ndarray:
    """k neurons: about half of the previous step's, the rest anywhere (the set moves with the text)."""
    keep = rng.choice(prev, size=min(prev.size, k // 2), replace=False) if prev.size else prev
    fresh = rng.choice(n, size=k, replace=False)
    return np.unique(np.concatenate([keep, fresh]))[:k]


@pytest.mark.parametrize("n,cap,window,seed", [(64, 64, 3, 0), (200, 60, 4, 1), (97, 30, 6, 2), (50, 12, 1, 3)])
def test_random_steps_keep_exactly_the_window(n, cap, window, seed):
    rng = np.random.default_rng(seed)
    table = _records(n, seed)
    c, model = NeuronCache(n, cap, R), {}
    prev = np.empty(0, dtype=np.int64)
    for step in range(1, 301):
        act = _active(rng, prev, n, int(rng.integers(1, cap + 1)))
        rng.shuffle(act)
        miss = c.admit(act, step, window)
        for i in act:
            if int(i) in model:
                model[int(i)] = step
        _model_evict(model, step, window)
        want = sorted(set(act.tolist()) - set(model))
        assert miss.tolist() == want
        assert _model_make_room(model, cap, len(want), step)
        c.insert(miss, table[torch.from_numpy(miss)], step)
        model.update((i, step) for i in want)
        _consistent(c, model, table)
        assert (c.slots(act).numpy() >= 0).all()
        prev = act


def _bare_op(rng, c: NeuronCache, model: dict, table: torch.Tensor, step: int) -> None:
    """One of touch / evict / make_room / insert, on the cache and the model alike."""
    op = rng.integers(4)
    if op == 0:
        some = rng.choice(c.n_neurons, size=int(rng.integers(1, 10)), replace=False)
        c.touch(some, step)
        model.update((int(i), step) for i in some if int(i) in model)
    elif op == 1:
        window = int(rng.integers(1, 5))
        gone = c.evict(step, window)
        before = set(model)
        _model_evict(model, step, window)
        assert sorted(gone.tolist()) == sorted(before - set(model))
    elif op == 2:
        k = int(rng.integers(0, c.capacity + 2))
        trial = dict(model)
        if _model_make_room(trial, c.capacity, k, step):
            c.make_room(k, step)
            model.clear()
            model.update(trial)
            assert c.free >= k
        else:
            with pytest.raises(CadenceError, match="capacity"):
                c.make_room(k, step)
    else:
        absent = np.setdiff1d(np.arange(c.n_neurons), np.array(list(model), dtype=np.int64))
        new = rng.choice(absent, size=min(absent.size, c.free, int(rng.integers(0, 6))), replace=False)
        c.insert(new, table[torch.from_numpy(new.astype(np.int64))], step)
        model.update((int(i), step) for i in new)


@pytest.mark.parametrize("seed", range(4))
def test_random_bare_operations_stay_consistent(seed):
    rng = np.random.default_rng(100 + seed)
    n, cap = 80, 25
    table = _records(n, seed)
    c, model = NeuronCache(n, cap, R), {}
    for step in range(1, 2001):
        _bare_op(rng, c, model, table, step // 3)  # several operations per step: equal last steps, ties
        _consistent(c, model, table)


def test_swap_delete_moves_only_the_last_rows_into_the_holes():
    table = _records(10)
    c = NeuronCache(10, 10, R)
    c.insert(np.arange(10), table, step=1)
    c.touch([0, 2, 3, 4, 5, 6, 8], step=2)  # 1, 7 and 9 fall out of a window of 1
    assert sorted(c.evict(2, 1).tolist()) == [1, 7, 9]
    # row 1 freed below the new end (7) takes the one survivor past it (neuron 8, row 8); the rest stay put
    assert c.ids[:7].tolist() == [0, 8, 2, 3, 4, 5, 6] and c.num_used == 7
    assert torch.equal(c.matrix[1], table[8])


def test_make_room_refuses_to_drop_the_current_steps_neurons():
    c = NeuronCache(20, 4, R)
    c.insert([1, 2, 3], _records(3), step=5)
    with pytest.raises(CadenceError, match="step 5 needs 3 cached and 2 more"):
        c.make_room(2, 5)
    assert c.num_used == 3  # nothing evicted by the refusal
    assert sorted(c.make_room(2, 6).tolist()) == [1]  # a later step: the oldest (ties: lower id) go


def test_storage_holds_the_matrix_and_bad_input_is_one_sentence():
    store = torch.zeros(5 * R + 7, dtype=torch.uint8).share_memory_()
    c = NeuronCache(30, 5, R, storage=store)
    c.insert([4], _records(1), step=0)
    assert c.matrix.data_ptr() == store.data_ptr() and torch.equal(store[:R], _records(1)[0])
    with pytest.raises(CadenceError, match="needs 200 contiguous bytes"):
        NeuronCache(30, 5, R, storage=torch.zeros(100, dtype=torch.uint8))
    with pytest.raises(CadenceError, match="not in the cache"):
        c.slots([4, 5])
    with pytest.raises(CadenceError, match="neuron ids lie in"):
        c.missing([30])
    with pytest.raises(CadenceError, match="not cached yet"):
        c.insert([4], _records(1))
    with pytest.raises(CadenceError, match="free rows"):
        c.insert([0, 1, 2, 3, 5], _records(5))
