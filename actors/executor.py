"""The split executor: what of a verifier job the sparse worker computes, and both sides' steps.

Once per forward, the verifier's executor decides the split (`plan_split`, Ghidorah): the worker
takes each row's attention chunks from key k0 on (the tree part, plus a share of the dense
chunks) and, with a column share, the columns [n0, N) of every linear layer. It writes the plan
into the sync area (actors/syncarea.py); from then on both sides walk the same list of steps
(`SplitPlan.steps`) and meet at the sync words, with no message per layer:

    verifier: SplitExecutor                    worker: WorkerShare (one `serve` request per job)
    plan -> post                               wait plan, read it
    layer i: Q -> post, dense chunks [0, k0)   wait Q, chunks [k0, ...) -> post
             wait, merge in chunk order
    linear:  input -> post, columns [0, n0)    wait input, columns [n0, N) -> post
             wait, go on
    job done: END -> post                      wait, read END, reply

The model (models/transformer.py) only hands out `SplitAttention` / `SplitColumns` requests; the
kernels are the same as one unit's, so the merged results are bit for bit the unsplit ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from actors.syncarea import ABANDONED, END, FORWARD, VERIFIER, WORKER, Clock, SyncArea
from models import split_attention
from models.attention import Visibility
from models.args import ModelArgs
from models.linear import column_split
from models.requests import ForwardPlan, SplitAttention, SplitColumns

# a layer's linears in the order a forward meets them; True: the output is added to the residual
LINEARS = (("qkv", False), ("attn_out", True), ("gate_up", False), ("down", True))
_COLS = {name: j for j, (name, _) in enumerate(LINEARS)}
ACCUMULATE = dict(LINEARS)


def linear_widths(a: ModelArgs) -> tuple[int, ...]:
    """Output columns of each of a layer's LINEARS."""
    return (a.q_dim + 2 * a.kv_dim, a.dim, 2 * a.ffn_dim, a.dim)


@dataclass(frozen=True)
class SplitPlan:
    """One forward's split between the verifier and the worker."""

    T: int
    n_shared: int
    k0: int  # the worker's attention: each row's keys from k0 on (a multiple of split_attention.CHUNK)
    maxc: int  # chunk states a row of the worker's can have
    scale: float
    n0: tuple[int, ...] | None  # per LINEARS: the worker's first column; None: the linears are not split
    ptr: torch.Tensor  # int32 [T + 1], idx int32 [nnz]: which tree slots each row sees (models/attention.py)
    idx: torch.Tensor

    def steps(self, n_layers: int) -> list[tuple[int, str]]:
        """(layer, "attn" or a linear's name), in the order both sides meet them."""
        per_layer = ("qkv", "attn", "attn_out", "gate_up", "down") if self.n0 else ("attn",)
        return [(i, name) for i in range(n_layers) for name in per_layer]

    def write(self, area: SyncArea):
        T, nnz = self.T, self.idx.numel()
        if T > area.rows or nnz > area.idx.size:
            raise ValueError(
                f"a forward of {T} rows ({nnz} tree entries) does not fit the sync area of {area.rows} rows"
            )
        area.ptr[: T + 1] = self.ptr.numpy()
        area.idx[:nnz] = self.idx.numpy()
        h = area.header
        h[:6] = (FORWARD, T, self.n_shared, self.k0, self.maxc, nnz)
        h[6:10] = self.n0 if self.n0 else (-1,) * 4
        h[10] = np.float64(self.scale).view(np.int64)

    @staticmethod
    def read(area: SyncArea) -> "SplitPlan | None":
        """The plan the verifier posted (copied out), or None: the job has ended."""
        h = area.header
        if int(h[0]) == END:
            return None
        T, n_shared, k0, maxc, nnz = (int(v) for v in h[1:6])
        n0 = tuple(int(v) for v in h[6:10])
        return SplitPlan(
            T,
            n_shared,
            k0,
            maxc,
            float(h[10:11].view(np.float64)[0]),
            None if n0[0] < 0 else n0,
            torch.from_numpy(area.ptr[: T + 1].copy()),
            torch.from_numpy(area.idx[:nnz].copy()),
        )


def plan_split(
    vis: Visibility, args: ModelArgs, share: float, column_share: float, scale: float, ch_room: int | None = None
) -> SplitPlan:
    """The worker takes `share` of the chunks made of shared context only (the last ones), the tree part
    of every row, and with `column_share` > 0 the last share of every linear layer's columns. `ch_room`:
    the fp32 values its chunk states may fill; a long context leaves it fewer dense chunks to fit them
    (any split gives the same bits)."""
    c_star = vis.n_shared // split_attention.CHUNK
    k0 = int(c_star * (1.0 - share)) * split_attention.CHUNK  # ours: keys [0, k0); the worker's: the rest
    if ch_room is not None:
        fit = ch_room // (vis.rows * args.n_heads * (args.head_dim + 2))  # chunk states a row may have
        longest = int((vis.ptr[1:] - vis.ptr[:-1]).max()) if vis.rows else 0
        least = (
            -(-(vis.n_shared + longest - fit * split_attention.CHUNK) // split_attention.CHUNK) * split_attention.CHUNK
        )
        k0 = min(max(k0, least), c_star * split_attention.CHUNK)
    maxc = split_attention.max_chunks(vis.n_shared, vis.ptr, k0)
    if ch_room is not None and vis.rows * args.n_heads * maxc * (args.head_dim + 2) > ch_room:
        raise ValueError(f"the worker's chunk states of {vis.rows} rows do not fit its slot of {ch_room * 4} bytes")
    n0 = tuple(column_split(n, column_share) for n in linear_widths(args)) if column_share > 0 else None
    return SplitPlan(vis.rows, vis.n_shared, k0, maxc, scale, n0, vis.ptr, vis.idx)


def step_name(layer: int, name: str) -> str:
    return f"layer {layer}'s attention" if name == "attn" else f"layer {layer}'s {name} columns"


class SplitExecutor:
    """The verifier's side: plans each forward of a job and answers the model's split requests with
    its own share, meeting the worker at the sync area."""

    def __init__(self, model, share: float, column_share: float, trace):
        self.model, self.share, self.trace = model, share, trace
        self.column_share = column_share if model.fused else 0.0
        self.area = None

    def begin(self, job: int, rows: int, tensors: dict[str, torch.Tensor], clock: Clock):
        """A job the worker serves: the arena slots (sync, q, ch, and with columns x, xin, y), mapped."""
        self.job, self.seq, self.clock = job, 0, clock
        self.area = SyncArea(tensors["sync"], rows)
        self.q, self.ch = tensors["q"].view(torch.float32), tensors["ch"].view(torch.float32)
        cols = self.column_share > 0 and "x" in tensors
        self.bufs = tuple(tensors[k].view(torch.float32) for k in ("x", "xin", "y")) if cols else None
        self.split, self.todo = None, iter(())

    def plan(self, vis: Visibility) -> ForwardPlan | None:
        """This forward's split (None: a single row, nothing to share); the worker learns it now."""
        if self.area is None or vis.rows < 2 or not self.model.fused:
            return None
        share = self.column_share if self.bufs is not None else 0.0
        sp = plan_split(vis, self.model.args, self.share, share, self.model.scale, self.ch.numel())
        sp.write(self.area)
        self._post()
        self.split, self.todo = sp, iter(sp.steps(self.model.args.n_layers))
        return ForwardPlan(attn_split=True, column_share=share, bufs=self.bufs if share else None)

    def answer(self, req):
        """Our share of a `SplitAttention` / `SplitColumns`, the worker's merged in: what the model waits for."""
        layer, name = next(self.todo, (None, None))
        mine = (req.layer, "attn" if isinstance(req, SplitAttention) else req.name)
        if (layer, name) != mine:
            raise RuntimeError(
                f"the model asked for {step_name(*mine)} but the plan's next step is "
                f"{step_name(layer, name) if layer is not None else 'none'}"
            )
        self.clock.maybe_beat()
        return self._attend(req) if name == "attn" else self._columns(req)

    def _attend(self, req: SplitAttention) -> torch.Tensor:
        sp, i, q = self.split, req.layer, req.q
        T, H, D = q.shape
        self.q[: q.numel()].copy_(q.reshape(-1))
        self._post()  # Q is in the arena: the worker starts its chunks
        with self.trace.span(f"dense:layer.{i}", cat="attention", args={"chunks": sp.k0 // split_attention.CHUNK}):
            state = split_attention.attn_dense(q, req.k, req.v, 0, sp.k0 // split_attention.CHUNK, sp.scale)
        self._wait(i, "attn")
        ch = self.ch[: T * H * sp.maxc * (D + 2)].view(T, H, sp.maxc, D + 2)
        return split_attention.attn_merge(state, ch, torch.from_numpy(self.area.nch[:T]))

    def _columns(self, req: SplitColumns) -> None:
        i, lin, x = req.layer, req.linear, req.x
        n0 = self.split.n0[_COLS[req.name]]
        self._post()  # the input is in the shared buffer: the worker starts its columns
        with self.trace.span(f"cols:layer.{i}.{req.name}", cat="verify", args={"rows": x.shape[0], "cols": n0}):
            lin.matmul_cols(x, req.y, 0, n0, req.accumulate)
        self._wait(i, req.name)

    def _post(self):
        self.seq += 1
        self.area.post(VERIFIER, self.job, self.seq)

    def _wait(self, layer: int, name: str):
        self.area.wait(WORKER, self.job, self.seq, step_name(layer, name), self.clock)

    def end(self):
        """The job is done: the worker replies and goes."""
        if self.area is not None:
            self.area.header[0] = END
            self._post()
            self.area = None

    def abandon(self):
        """The job failed here: the worker stops waiting at once."""
        if self.area is not None:
            self.area.post(VERIFIER, self.job, ABANDONED)
            self.area = None


class WorkerShare:
    """The worker's side: follows the verifier's plans step by step through one job and computes its
    share of each step: attention chunks from k0 on (into `ch`, their counts into the sync area),
    columns [n0, N) of each linear (input from `xin`, output into `x` or `y`)."""

    def __init__(
        self, args: ModelArgs, cache, layers: list | None, area: SyncArea, slots: dict[str, torch.Tensor], trace
    ):
        """`cache`: the verifier's KV cache, mapped; `layers`: the target's layer weights (None: no column share)."""
        self.args, self.cache, self.layers, self.area, self.trace = args, cache, layers, area, trace
        self.q, self.ch = slots["q"].view(torch.float32), slots["ch"].view(torch.float32)
        self.bufs = {k: slots[k].view(torch.float32) for k in ("x", "xin", "y") if k in slots}

    def serve(self, job: int, clock: Clock) -> int:
        """Until the verifier's END for `job`; the number of forwards served."""
        area, seq, forwards = self.area, 0, 0
        try:
            while True:
                seq += 1
                ended = not area.wait(VERIFIER, job, seq, "the next forward's plan", clock, newer_ends=True)
                plan = None if ended else SplitPlan.read(area)
                if plan is None:
                    return forwards
                forwards += 1
                for layer, name in plan.steps(self.args.n_layers):
                    seq += 1
                    area.wait(VERIFIER, job, seq, f"the input of {step_name(layer, name)}", clock)
                    if name == "attn":
                        self.attend(plan, layer)
                    else:
                        self.columns(plan, layer, name)
                    area.post(WORKER, job, seq)
        except BaseException:
            area.post(WORKER, job, ABANDONED)
            raise

    def attend(self, plan: SplitPlan, i: int):
        T, H, D = plan.T, self.args.n_heads, self.args.head_dim
        q = self.q[: T * H * D].view(T, H, D)
        with self.trace.span(f"sparse:layer.{i}", cat="attention", args={"rows": T, "k0": plan.k0}):
            _, nch = split_attention.attn_chunks(
                q,
                *self.cache.kv(i)[:2],
                plan.n_shared,
                plan.ptr,
                plan.idx,
                plan.k0,
                plan.scale,
                plan.maxc,
                out=self.ch,
            )
        self.area.nch[:T] = nch.numpy()

    def columns(self, plan: SplitPlan, i: int, name: str):
        if self.layers is None or "xin" not in self.bufs:
            raise RuntimeError("this worker was started without a column share; start it with --column-share")
        lin, T, acc = getattr(self.layers[i], name), plan.T, ACCUMULATE[name]
        n0 = plan.n0[_COLS[name]]
        x = self.bufs["xin"][: T * lin.k].view(T, lin.k)
        y = self.bufs["x" if acc else "y"][: T * lin.n].view(T, lin.n)
        with self.trace.span(f"cols:layer.{i}.{name}", cat="linear", args={"rows": T, "cols": lin.n - n0}):
            lin.matmul_cols(x, y, n0, lin.n, acc)
