"""One layer's sliding-window neuron cache (LLM in a flash §3.1) in a preallocated matrix (§3.3).

The paper's "Optimized Data Management in DRAM": a matrix of `capacity` rows is allocated once; the
neurons in memory are its rows [0, num_used), densely, with a pointer array saying which neuron each
row holds and, per row, the last step its neuron was predicted active (last_k_active). Deleting neurons
moves the last used rows into the freed ones (O(deleted) row copies, no reallocation, the rows stay
dense); inserting copies the new records to rows num_used.. . The FFN kernel (`kernels.flash_ffn`) then
reads the rows `slots(neurons)` of the matrix in place.

The window. Step s keeps every neuron predicted active at steps s - window + 1 .. s (`evict`). Under a
fixed memory the matrix may be too small for the whole window: `make_room` then evicts the neurons
least recently active first (ties: lower neuron id first), i.e. the window shrinks to what the capacity
holds. The neurons active at the current step are never evicted to make room for more.

No I/O here: `admit` says which neurons are missing (after evicting and making room for them), the caller
reads their records (the bundle reader) and passes them to `insert`.
"""

from __future__ import annotations

import numpy as np
import torch

from common.errors import CadenceError


def _ids(neurons) -> np.ndarray:
    return np.asarray(neurons.numpy() if isinstance(neurons, torch.Tensor) else neurons, dtype=np.int64).reshape(-1)


class NeuronCache:
    """matrix uint8 [capacity, R]: records; ids int32 [capacity]: the neuron in each row (-1 past num_used);
    slot_of int32 [n_neurons]: each neuron's row (-1 when absent); last_active int64 [capacity]: the step each
    row's neuron was last predicted active; num_used: rows in use, [0, num_used)."""

    def __init__(self, n_neurons: int, capacity: int, record_bytes: int, storage: torch.Tensor | None = None):
        if capacity < 1 or n_neurons < 1 or record_bytes < 1:
            raise CadenceError(
                f"a neuron cache needs a positive capacity and record size, not {capacity} x {record_bytes}"
            )
        capacity = min(capacity, n_neurons)
        need = capacity * record_bytes
        if storage is None:
            self.matrix = torch.zeros(capacity, record_bytes, dtype=torch.uint8)
        elif storage.dtype != torch.uint8 or not storage.is_contiguous() or storage.numel() < need:
            raise CadenceError(
                f"a neuron cache of {capacity} records of {record_bytes} bytes needs {need} contiguous "
                f"bytes of storage; it was given {storage.numel() * storage.element_size()}"
            )
        else:
            self.matrix = storage.reshape(-1)[:need].view(capacity, record_bytes)
        self.n_neurons, self.capacity, self.record_bytes = n_neurons, capacity, record_bytes
        self.ids = np.full(capacity, -1, dtype=np.int32)
        self.slot_of = np.full(n_neurons, -1, dtype=np.int32)
        self.last_active = np.zeros(capacity, dtype=np.int64)
        self.num_used = 0
        self.now = 0  # the latest step seen

    # ------------------------------------------------------------------ queries
    def _check(self, ids: np.ndarray) -> np.ndarray:
        if ids.size and (ids.min() < 0 or ids.max() >= self.n_neurons):
            raise CadenceError(f"neuron ids lie in [0, {self.n_neurons}); got {int(ids.min())}..{int(ids.max())}")
        return ids

    def missing(self, neurons) -> np.ndarray:
        """The neurons (of `neurons`) not in the cache, in their order."""
        ids = self._check(_ids(neurons))
        return ids[self.slot_of[ids] < 0]

    def slots(self, neurons) -> torch.Tensor:
        """The rows of `neurons` (all cached), int32, in their order: what `kernels.flash_ffn` takes."""
        ids = self._check(_ids(neurons))
        s = self.slot_of[ids]
        if (s < 0).any():
            raise CadenceError(f"{int((s < 0).sum())} of the {ids.size} neurons asked for are not in the cache")
        return torch.from_numpy(s.astype(np.int32))

    def cached(self) -> np.ndarray:
        """The neurons in the cache, in row order."""
        return self.ids[: self.num_used].astype(np.int64)

    @property
    def free(self) -> int:
        return self.capacity - self.num_used

    @property
    def nbytes(self) -> int:
        """The matrix and its bookkeeping."""
        arrays = (self.ids, self.slot_of, self.last_active)
        return self.matrix.numel() + sum(a.nbytes for a in arrays)

    # ------------------------------------------------------------------ updates
    def touch(self, neurons, step: int) -> None:
        """Mark the cached ones of `neurons` active at `step` (absent ones are ignored: `insert` marks them)."""
        ids = self._check(_ids(neurons))
        s = self.slot_of[ids]
        self.last_active[s[s >= 0]] = step
        self.now = max(self.now, step)

    def insert(self, neurons, records: torch.Tensor, step: int | None = None) -> None:
        """Copy the records [k, R] of `neurons` (none cached yet) into rows num_used.., active at `step`
        (default: the latest step seen). The caller makes room first (`make_room`, `admit`)."""
        ids = self._check(_ids(neurons))
        k = ids.size
        if tuple(records.shape) != (k, self.record_bytes) or records.dtype != torch.uint8:
            raise CadenceError(
                f"insert takes {k} records of {self.record_bytes} bytes (uint8), not {tuple(records.shape)}"
            )
        if k > self.free:
            raise CadenceError(f"the neuron cache has {self.free} free rows; {k} neurons do not fit (make room first)")
        if (self.slot_of[ids] >= 0).any() or np.unique(ids).size != k:
            raise CadenceError("insert takes neurons that are not cached yet, each once")
        rows = np.arange(self.num_used, self.num_used + k)
        self.matrix[self.num_used : self.num_used + k] = records
        self.ids[rows] = ids
        self.slot_of[ids] = rows
        when = self.now if step is None else step
        self.last_active[rows] = when
        self.now = max(self.now, when)
        self.num_used += k

    def _delete(self, rows: np.ndarray) -> np.ndarray:
        """Delete the neurons in `rows` (distinct, < num_used): the last used rows that survive move into the
        freed rows below the new end, one row copy per move. Returns the deleted neurons."""
        gone = self.ids[rows].astype(np.int64)
        if not rows.size:
            return gone
        end = self.num_used - rows.size
        dead = np.zeros(self.num_used, dtype=bool)
        dead[rows] = True
        holes = np.flatnonzero(dead[:end])  # freed rows that stay in use
        movers = end + np.flatnonzero(~dead[end:])  # survivors past the new end: as many as holes
        self.slot_of[gone] = -1
        if holes.size:
            h, m = torch.from_numpy(holes), torch.from_numpy(movers)
            self.matrix[h] = self.matrix[m]
            self.ids[holes] = self.ids[movers]
            self.last_active[holes] = self.last_active[movers]
            self.slot_of[self.ids[holes]] = holes
        self.ids[end : self.num_used] = -1
        self.num_used = end
        return gone

    def evict(self, step: int, window: int) -> np.ndarray:
        """Delete every neuron not active in the last `window` steps (step - window + 1 .. step); returns them."""
        if window < 1:
            raise CadenceError(f"the neuron window must be at least one step, not {window}")
        self.now = max(self.now, step)
        stale = np.flatnonzero(self.last_active[: self.num_used] <= step - window)
        return self._delete(stale)

    def make_room(self, k: int, step: int) -> np.ndarray:
        """Free at least k rows by evicting the least recently active neurons (ties: lower id first), never one
        active at `step`: the window shrinks to what the capacity holds. Returns the evicted neurons."""
        need = k - self.free
        if need <= 0:
            return np.empty(0, dtype=np.int64)
        last, ids = self.last_active[: self.num_used], self.ids[: self.num_used]
        order = np.lexsort((ids, last))[:need]
        if k > self.capacity or (last[order] >= step).any():
            now = int((last >= step).sum())
            raise CadenceError(
                f"the neuron cache holds {self.capacity} neurons; step {step} needs {now} cached and "
                f"{k} more: raise its capacity or lower the density"
            )
        return self._delete(order)

    def admit(self, neurons, step: int, window: int | None = None) -> np.ndarray:
        """One step of the window (§3.1): mark `neurons` active, evict those out of the window (None: no window
        but the capacity, least recently active first), make room for the missing ones and return them (the
        caller reads their records and calls `insert(missing, records, step)`)."""
        self.touch(neurons, step)
        if window is not None:
            self.evict(step, window)
        miss = np.unique(self.missing(neurons))
        self.make_room(miss.size, step)
        return miss
