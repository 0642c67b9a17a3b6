"""The KV cache: keys and values of every layer, committed and pending, in global slots.

Slots [0, length) are committed, in position order (slot s holds position s); slots [length, end) are
pending: written by forwards since the last commit (a verified block, or a draft tree fed one node at a
time). `commit(keep)` keeps the chosen pending entries, in order, and drops the rest.

A full-attention layer keeps every slot. A sliding-window layer (Gemma 2/3, Mistral v0.1, Qwen 2's upper
layers) keeps only what a query can still see: its rows hold global slots [base, end), and when a forward
needs room, the rows below `length - (window - 1) - REWIND` are dropped (the rest moved down), so a long
context costs a window's memory there. A recurrent layer (LFM2's convolutions, Qwen 3.5's gated delta-nets:
models/recurrent.py) keeps a state and rows of its recent tokens instead of keys and values: `commit(keep)` keeps
the accepted path's rows as it keeps keys, and the next forward folds them into the state. Rows are addressed
globally everywhere else; `layer(i)` says where a
layer's rows start, and `window_vis` turns a block's visibility into the sliding layers' own (each row's
keys in the window, in order, in their rows).
"""

from __future__ import annotations

import math
import mmap
from typing import Sequence

import torch

from common.errors import CadenceError
from models.attention import Visibility
from models.args import ModelArgs
from models.shapes import WINDOW_REWIND as REWIND, kv_row_bytes
from models.recurrent import fold

# --kv-dtype: the keys' and values' element (q8: a row's bytes, blocks of llama.cpp's q8_0: models/csrc/vec.hpp)
KV_DTYPES = {"f32": torch.float32, "f16": torch.float16, "q8": torch.uint8}


class KVCache:
    """Keys and values: full layers [n_full, Hkv, capacity, D], sliding ones [n_slide, Hkv, rows, D]; recurrent
    layers' rows [n_rec, rec_rows, rec_width] and states [n_rec, *rec_state]."""

    def __init__(
        self,
        args: ModelArgs,
        capacity: int,
        device: str | torch.device = "cpu",
        storage: torch.Tensor | None = None,
        dtype: str = "f32",
    ):
        """`storage`: a float32 tensor of `KVCache.numel(args, capacity, dtype)` elements to live in (shared memory).
        `dtype`: the keys' and values' (--kv-dtype: f32; f16 rounded to nearest; q8, each row llama.cpp's q8_0 blocks,
        [.., rows, its bytes]); recurrent rows and states stay float32."""
        self.args, self.capacity, self.device, self.dtype = args, capacity, device, dtype
        self.window = args.sliding_window if args.sliding_layers else 0
        n_slide, n_rec = args.n_sliding, len(args.rec_layers)
        self.rows = args.window_rows(capacity)
        self.owned = storage is None
        d_full, q8 = args.full_head_dim or args.head_dim, dtype == "q8"  # q8: each row its bytes (models/shapes.py)
        full = (args.full_kv_heads or args.n_kv_heads, capacity, kv_row_bytes(d_full, dtype) if q8 else d_full)
        slide = (args.n_kv_heads, self.rows, kv_row_bytes(args.head_dim, dtype) if q8 and n_slide else args.head_dim)
        shapes = [(2, args.n_full, *full), (2, n_slide, *slide)]
        shapes += [(n_rec, args.rec_rows(capacity), args.rec_width), (n_rec, *args.rec_state)]
        dtypes = [KV_DTYPES[dtype]] * 2 + [torch.float32] * 2
        if storage is None and torch.device(device).type == "cpu":
            # each part a mapping of its own, whose pages the kernel zero-fills as forwards first write them: zeros
            # written over the whole cache cost each new prompt a page fault every 4 KiB, rows it never reaches
            # included (and a part that grows frees its old mapping)
            parts = [zero_pages(math.prod(shape) * t.itemsize).view(t).view(shape) for shape, t in zip(shapes, dtypes)]
        elif storage is None:
            parts = [torch.zeros(shape, device=device, dtype=t) for shape, t in zip(shapes, dtypes)]
        else:
            flat, parts, lo = storage.view(torch.uint8), [], 0
            for shape, t in zip(shapes, dtypes):
                size = math.prod(shape) * t.itemsize  # even counts of halves: every part starts 4-byte aligned
                parts.append(flat[lo : lo + size].view(t).view(shape))
                lo += size
        (self.k, self.v), (self.wk, self.wv), self.rec, self.state = parts
        self.rbase = 0  # the global slot of a recurrent layer's row 0
        self.folded = 0  # the slots its state holds
        # a layer's rows (data_ptr) -> (first slot, end slot, the state there): a prompt chunk's, computed at once
        self.chains: dict = {}
        # a recurrent layer's second state buffer (`spare`), and its state where that buffer holds it, not the storage
        self.spares: dict[int, torch.Tensor] = {}
        self.now: dict[int, torch.Tensor] = {}
        # the next forward's rows are all to be kept (a decode step's, a prompt chunk's): a chain from the state
        # steps it in place, and the commit folds it (`spare`); a cache left so by a forward that never committed
        # holds a state past its text, and is not to be used again
        self.whole = False
        # layer i -> (kind, its index among its kind's layers)
        index, count = [], {"full": 0, "sliding": 0, "rec": 0, "none": 0}
        for i in range(args.n_layers):
            kind = "sliding" if args.sliding(i) else "full" if args.attends(i) else "none"
            kind = "rec" if args.recurrent(i) and kind == "none" else kind
            if args.shares_kv(i):  # Gemma 4: the rows of the layer it shares
                index.append(index[args.kv_source(i)])
                continue
            index.append((kind, count[kind]))
            count[kind] += 1
        self.index = index
        # a layer attending beside its recurrent mixer (Falcon-H1) -> its index among the recurrent layers
        self.rec_index = {i: j for j, i in enumerate(args.rec_layers)} if args.parallel_mixers else {}
        self.base = 0  # the global slot of a sliding layer's row 0
        self.pos = torch.zeros(capacity, dtype=torch.int64) if self.window else None  # each slot's position
        self.length = 0
        self.pending = 0

    @staticmethod
    def numel(args: ModelArgs, capacity: int, dtype: str = "f32") -> int:
        """The float32 elements of a cache's storage."""
        return args.kv_bytes(capacity, dtype) // 4

    @property
    def end(self) -> int:
        return self.length + self.pending

    def nbytes(self) -> int:
        kv = 2 * (self.k.numel() + self.wk.numel()) * self.k.element_size()
        return kv + (self.rec.numel() + self.state.numel()) * 4

    def kv(self, i: int) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """Layer i's keys and values [Hkv, rows, D] and the global slot of their row 0; a recurrent layer's rows
        [rec_rows, rec_width], its state (None: a convolution has none) and the global slot of its row 0."""
        kind, j = self.index[i]
        if kind == "sliding":
            return self.wk[j], self.wv[j], self.base
        if kind == "rec":
            return self.rec_kv(j)
        if kind == "none":  # an FFN-only layer (Nemotron-H): no cache
            return self.k[:0], self.v[:0], 0
        return self.k[j], self.v[j], 0

    def rec_kv(self, j: int) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """The j-th recurrent layer's rows [rec_rows, rec_width], state (None: a convolution has none) and the global
        slot of its row 0."""
        return self.rec[j], self.now.get(j, self.state[j]) if self.args.rec_kind != "conv" else None, self.rbase

    def spare(self, j: int) -> torch.Tensor | None:
        """The j-th recurrent layer's free state buffer: a forward of one chain from its state (a decode step, a prompt
        chunk) writes the chain's end state there, and the next fold has the two buffers change roles, with no copy.
        None: a convolution keeps no state."""
        if self.args.rec_kind == "conv":
            return None
        if self.whole and self.folded:  # every row is to be kept: the chain's end state written over the state itself
            return self.rec_kv(j)[1]  # (not a new cache's first: its pages, never touched, would fault twice each)
        if j in self.now:
            return self.state[j]
        if j not in self.spares:
            self.spares[j] = torch.empty_like(self.state[j])
        return self.spares[j]

    def reserve(self, positions: torch.Tensor):
        """Room for a forward of these rows' positions: sliding rows no query can see any more are dropped
        (or, in a cache of its own, the rows grow); their positions are noted for `window_vis`."""
        T = positions.numel()
        if self.end + T > self.capacity:
            raise CadenceError(
                f"the KV cache holds {self.capacity} tokens and {self.end + T} are needed; "
                "lower --max-new-tokens or shorten the prompt"
            )
        if self.args.rec_layers:
            self._reserve_recurrent(T)
        if not self.window:
            return
        self.pos[self.end : self.end + T] = positions.to(torch.int64).cpu()
        if self.end + T - self.base <= self.rows:
            return
        keep_from = max(self.base, self.length - (self.window - 1) - REWIND)
        n = self.end - keep_from
        if keep_from > self.base:
            src = keep_from - self.base
            self.wk[:, :, :n] = self.wk[:, :, src : src + n].clone()
            self.wv[:, :, :n] = self.wv[:, :, src : src + n].clone()
            self.base = keep_from
        if n + T > self.rows:
            if not self.owned:
                raise CadenceError(
                    f"a forward of {T} rows does not fit the sliding-window layers' {self.rows} rows; "
                    f"feed at most {self.rows - n} rows at a time"
                )
            grow = lambda t: torch.cat([t, t.new_zeros(t.shape[0], t.shape[1], n + T - self.rows, t.shape[3])], dim=2)
            self.wk, self.wv = grow(self.wk), grow(self.wv)
            self.rows = n + T

    def _reserve_recurrent(self, T: int) -> None:
        """The committed rows folded into the recurrent states, then room for T new rows: rows below the kernel's
        reach back from the committed text dropped (or, in a cache of its own, the rows grow)."""
        a = self.args
        self._fold()
        cap = self.rec.shape[1]
        if self.end + T - self.rbase <= cap:
            return
        keep_from = max(self.rbase, self.length - (a.conv_kernel - 1))
        n = self.end - keep_from
        if keep_from > self.rbase:
            src = keep_from - self.rbase
            self.rec[:, :n] = self.rec[:, src : src + n].clone()
            self.rbase = keep_from
        if n + T > cap:
            if not self.owned:
                raise CadenceError(
                    f"a forward of {T} rows does not fit the recurrent layers' {cap} rows; feed at most {cap - n} at a time"
                )
            self.rec = torch.cat([self.rec, self.rec.new_zeros(self.rec.shape[0], n + T - cap, self.rec.shape[2])], 1)

    def _fold(self) -> None:
        """The committed rows folded into the recurrent states: a chain's end state kept whole where one was (in
        place, in the spare or apart), else the rows stepped."""
        a = self.args
        if a.rec_kind != "conv" and self.length > self.folded:
            lo, hi = self.folded - self.rbase, self.length - self.rbase
            for j in range(len(a.rec_layers)):
                chain = self.chains.get(self.rec[j].data_ptr())
                if chain is not None and chain[:2] == (self.folded, self.length):  # a chain's end state, kept whole
                    self._take(j, chain[2])
                else:
                    fold(self.rec_kv(j)[1], self.rec[j, lo:hi], a)
                    if j not in self.now:  # (trees verified: a spare of its own goes until a chain asks again)
                        self.spares.pop(j, None)
        self.chains.clear()
        self.folded = self.length

    def _take(self, j: int, end: torch.Tensor) -> None:
        """The j-th recurrent layer's state becomes `end`: where the chain wrote it into the spare, the two buffers
        change roles; where it wrote it over the state (`whole`), nothing is left to do; else it is copied in."""
        if end.data_ptr() == self.rec_kv(j)[1].data_ptr():
            return
        if j in self.now and end.data_ptr() == self.state[j].data_ptr():
            del self.now[j]
        elif j not in self.now and j in self.spares and end.data_ptr() == self.spares[j].data_ptr():
            self.now[j] = self.spares[j]
        else:
            self.rec_kv(j)[1].copy_(end)

    def window_vis(self, vis: Visibility, positions: torch.Tensor) -> Visibility:
        """The sliding layers' visibility: row r sees the slots of `vis` whose positions lie in its window
        (> p_r - window), in the same order, as rows of the sliding layers (n_shared 0: rows differ)."""
        T = vis.rows
        lo = (positions.to(torch.int64).cpu() - self.window + 1).clamp(min=0)
        if bool(((lo < self.base) & (lo < vis.n_shared)).any()):
            raise CadenceError("a sliding-window layer lost rows a query still sees; this is a bug, please report it")
        ptr, idx = vis.ptr.long(), vis.idx.long()
        c = (vis.n_shared - lo).clamp(min=0)  # committed keys each row sees: [lo, n_shared)
        row = torch.repeat_interleave(torch.arange(T), ptr[1:] - ptr[:-1])
        keep = self.pos[idx] >= lo[row]
        o = torch.bincount(row[keep], minlength=T)
        newptr = torch.zeros(T + 1, dtype=torch.int64)
        newptr[1:] = (c + o).cumsum(0)
        out = torch.empty(int(newptr[-1]), dtype=torch.int64)
        rc = torch.repeat_interleave(torch.arange(T), c)
        within = torch.arange(rc.numel()) - torch.repeat_interleave(c.cumsum(0) - c, c)
        out[newptr[rc] + within] = lo[rc] + within
        ro = row[keep]
        rank = torch.arange(ro.numel()) - torch.repeat_interleave(o.cumsum(0) - o, o)
        out[newptr[ro] + c[ro] + rank] = idx[keep]
        return Visibility(0, newptr.to(torch.int32), (out - self.base).to(torch.int32))

    def commit(self, keep: Sequence[int] | None = None):
        """Keep pending entries `keep` (ascending indices into the pending slots) in order; drop the rest."""
        if keep is None:
            self.length += self.pending
            self.pending = 0
            if self.whole:  # the chains stepped the states in place: they hold the text now
                self.whole = False
                self._fold()
            return
        if self.whole:  # a forward said to keep every row stepped the states in place, then failed before its commit
            raise CadenceError("this cache's recurrent states were left mid-forward; start the generation again")
        keep = list(keep)
        if any(b <= a for a, b in zip(keep, keep[1:])) or (keep and not 0 <= keep[0] <= keep[-1] < self.pending):
            raise ValueError(f"keep={keep} must be ascending indices into the {self.pending} pending entries")
        n, L = len(keep), self.length
        if keep != list(range(n)):
            src = torch.tensor(keep, device=self.k.device) + L
            self.k[:, :, L : L + n] = self.k[:, :, src]
            self.v[:, :, L : L + n] = self.v[:, :, src]
            if self.args.rec_layers:
                self.rec[:, L - self.rbase : L - self.rbase + n] = self.rec[:, src - self.rbase]
            if self.window:
                self.wk[:, :, L - self.base : L - self.base + n] = self.wk[:, :, src - self.base]
                self.wv[:, :, L - self.base : L - self.base + n] = self.wv[:, :, src - self.base]
                self.pos[L : L + n] = self.pos[src.cpu()]
        self.length += n
        self.pending = 0

    def can_rewind(self, length: int) -> bool:
        """Whether the sliding layers still hold what a query at `length` sees, and the recurrent layers their state
        there (a state cannot step back past what it folded; a convolution needs its taps' rows)."""
        return self._rewinds(length, self.length, self.base, self.rbase, self.folded)

    def _rewinds(self, n: int, length: int, base: int, rbase: int, folded: int) -> bool:
        if not 0 <= n <= length or (self.window and max(0, n - self.window + 1) < base):
            return False
        if not self.args.rec_layers:
            return True
        if self.args.rec_kind != "conv":
            return n >= folded
        return not self.args.conv_layers or max(0, n - self.args.conv_kernel + 1) >= rbase

    def rewind(self, length: int):
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot rewind a cache of {self.length} entries to {length}")
        if not self.can_rewind(length):
            raise ValueError(f"cannot rewind to {length}: the sliding-window layers dropped the rows it needs")
        self.length, self.pending = length, 0

    def committed(self) -> tuple[dict, dict]:
        """The committed cache as (its marks, views of its parts), for speculative/prefixes.py to keep past this cache:
        each kind's committed rows, the recurrent states and where their rows start, a prompt chunk's state kept
        whole. A new cache that `adopt`s the marks and gets the parts copied in is this one, to the bit."""
        marks = {"length": self.length, "base": self.base, "rbase": self.rbase, "folded": self.folded, "chains": {}}
        views = self._parts(marks)
        for j in range(len(self.args.rec_layers)):
            chain = self.chains.get(self.rec[j].data_ptr())
            if chain is not None:
                marks["chains"][str(j)] = [int(chain[0]), int(chain[1])]
                views[f"chain{j}"] = chain[2]
        return marks, views

    def _parts(self, marks: dict) -> dict:
        L = marks["length"]
        parts = {"k": self.k[:, :, :L], "v": self.v[:, :, :L]}
        if self.window:
            n = L - marks["base"]
            parts.update(wk=self.wk[:, :, :n], wv=self.wv[:, :, :n], pos=self.pos[:L])
        if self.args.rec_layers:
            state = self.state  # (where a spare holds a state: the states as they are, copied)
            state = torch.stack([self.rec_kv(j)[1] for j in range(len(state))]) if self.now else state
            parts.update(rec=self.rec[:, : L - marks["rbase"]], state=state)
        return parts

    def fits(self, marks: dict, n: int) -> bool:
        """Whether the cache `marks` describe goes into this one (its rows of each kind within this one's) and rewinds
        to its first `n` tokens."""
        L = marks["length"]
        return (
            self._rewinds(n, L, marks["base"], marks["rbase"], marks["folded"])
            and L <= self.capacity
            and (not self.window or L - marks["base"] <= self.wk.shape[2])
            and (not self.args.rec_layers or L - marks["rbase"] <= self.rec.shape[1])
        )

    def adopt(self, marks: dict) -> dict:
        """This cache made the one `marks` (of `committed`) describe, but for its parts' values: the views to copy
        them into (`fits` must hold)."""
        self.base, self.rbase, self.folded = marks["base"], marks["rbase"], marks["folded"]
        self.now = {}  # (the states copied into the storage)
        views = self._parts(marks)
        self.chains = {}
        for j, (first, end) in marks["chains"].items():
            views[f"chain{j}"] = state = torch.empty_like(self.state[int(j)])
            self.chains[self.rec[int(j)].data_ptr()] = (first, end, state)
        self.length, self.pending = marks["length"], 0
        return views


def zero_pages(nbytes: int) -> torch.Tensor:
    """A cache's zeros: a private anonymous mapping, its pages zero-filled by the kernel as they are first touched
    (the rows a generation never reaches are never touched), freed with the tensor."""
    if nbytes == 0 or not hasattr(mmap, "MAP_PRIVATE"):  # (MAP_PRIVATE: not on Windows)
        return torch.zeros(nbytes, dtype=torch.uint8)
    return torch.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), dtype=torch.uint8)
