"""Our transformer for the Llama / Qwen family: RMSNorm, rotary embeddings, GQA, q/k norms, SwiGLU,
dense or a mixture of experts.

`forward` scores a block of new tokens with explicit positions and an explicit visibility
(causal, a token tree, or any mask), writes their keys and values to the cache as pending
entries, and the caller keeps the ones it wants (`KVCache.commit`). Weights come layer by
layer from a provider, so they can be resident or streamed; an MoE layer asks for the experts its
tokens route to once its router has answered (`NeedExperts`), so they can be streamed too.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F

from common.errors import CadenceError
from models import kernels, layer_kernel
from models.attention import Visibility, attend
from models.config import ModelArgs
from models.sampling import HeadArgmax
from models.requests import ForwardPlan, NeedExperts, NeedWeights, SplitAttention, SplitColumns


class KVCache:
    """Keys and values [n_layers, Hkv, capacity, D].

    Slots [0, length) are committed; slots [length, end) are pending: written by forwards since
    the last commit (a verified block, or a draft tree fed one node at a time). `commit(keep)`
    keeps the chosen pending entries, in order, and drops the rest.
    """

    def __init__(
        self, args: ModelArgs, capacity: int, device: str | torch.device = "cpu", storage: torch.Tensor | None = None
    ):
        """`storage`: a float32 tensor of `KVCache.numel(args, capacity)` elements to live in (shared memory)."""
        shape = (args.n_layers, args.n_kv_heads, capacity, args.head_dim)
        if storage is None:
            self.k = torch.zeros(shape, dtype=torch.float32, device=device)
            self.v = torch.zeros(shape, dtype=torch.float32, device=device)
        else:
            kv = storage.view(torch.float32)[: self.numel(args, capacity)].view(2, *shape)
            self.k, self.v = kv[0], kv[1]
        self.capacity = capacity
        self.length = 0
        self.pending = 0

    @staticmethod
    def numel(args: ModelArgs, capacity: int) -> int:
        return 2 * args.n_layers * args.n_kv_heads * capacity * args.head_dim

    @property
    def end(self) -> int:
        return self.length + self.pending

    def nbytes(self) -> int:
        return 2 * self.k.numel() * 4

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        # k, v: [T, Hkv, D] -> slots [end, end + T)
        T, e = k.shape[0], self.end
        self.k[layer, :, e : e + T] = k.transpose(0, 1)
        self.v[layer, :, e : e + T] = v.transpose(0, 1)

    def commit(self, keep: Sequence[int] | None = None):
        """Keep pending entries `keep` (ascending indices into the pending slots) in order; drop the rest."""
        if keep is None:
            self.length += self.pending
        else:
            keep = list(keep)
            if any(b <= a for a, b in zip(keep, keep[1:])) or (keep and not 0 <= keep[0] <= keep[-1] < self.pending):
                raise ValueError(f"keep={keep} must be ascending indices into the {self.pending} pending entries")
            n, L = len(keep), self.length
            if keep != list(range(n)):
                src = torch.tensor(keep, device=self.k.device) + L
                self.k[:, :, L : L + n] = self.k[:, :, src]
                self.v[:, :, L : L + n] = self.v[:, :, src]
            self.length += n
        self.pending = 0

    def rewind(self, length: int):
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot rewind a cache of {self.length} entries to {length}")
        self.length, self.pending = length, 0


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class Rotary:
    """cos/sin tables for rotate-half RoPE, grown on demand."""

    def __init__(self, head_dim: int, base: float, device):
        self.inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float().to(device) / head_dim))
        self.cos = self.sin = torch.empty(0, head_dim, device=device)

    def ensure(self, need: int):
        if need > self.cos.shape[0]:
            n = max(need, 2 * self.cos.shape[0], 256)
            freqs = torch.outer(torch.arange(n, device=self.inv_freq.device).float(), self.inv_freq)
            emb = torch.cat([freqs, freqs], dim=-1)
            self.cos, self.sin = emb.cos().contiguous(), emb.sin().contiguous()

    def tables(self, positions: torch.Tensor):
        self.ensure(int(positions.max().item()) + 1)
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)  # [T, 1, D]


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin


class Transformer:
    def __init__(self, args: ModelArgs, weights, device: str | torch.device = "cpu"):
        self.args, self.weights, self.device = args, weights, torch.device(device)
        self.rotary = Rotary(args.head_dim, args.rope_base, self.device)
        self.scale = 1.0 / math.sqrt(args.head_dim)
        # CPU: the fused row-wise kernels of models/csrc/ops.cpp; elsewhere: torch ops
        self.fused = self.device.type == "cpu" and args.dim % 16 == 0 and args.head_dim <= 1024 and kernels.available()
        self.layer_calls = self.fused  # a dense layer in one kernel call where it can (models/layer_kernel.py)
        # the requests for weights, made once: a forward yields the same ones every time
        self.layer_needs = [NeedWeights(f"layer.{i}", i) for i in range(args.n_layers)]
        self.head_needs = [NeedWeights(g, j) for j, g in enumerate(weights.head_groups)]
        self.lookahead = False  # MoE: guess the next layer's experts with its router (NeedExperts.guess)
        self.expert_batch = 0  # MoE: ask for at most this many experts at once (0: a layer's whole union)
        self.routes: list | None = (
            None  # MoE: when a list, each layer's (expert ids [T, k], weights [T, k], input h) is appended
        )
        self.ffn_inputs: list | None = None  # when a list, each layer's (i, FFN input h [T, dim]) is appended

    def new_cache(self, capacity: int, storage: torch.Tensor | None = None) -> KVCache:
        if capacity > self.args.context_length:
            raise CadenceError(
                f"{capacity} tokens exceed the model's context of {self.args.context_length}; "
                "shorten the prompt or lower --max-new-tokens"
            )
        return KVCache(self.args, capacity, self.device, storage)

    def block_fused(
        self,
        i: int,
        w,
        x: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        vis: Visibility,
        plan: ForwardPlan | None = None,
    ):
        """A generator (see `forward_steps`): yields a `SplitAttention` when the plan splits attention."""
        a = self.args
        if self.layer_calls and self.ffn_inputs is None and (plan is None or not plan.attn_split):
            rec = layer_kernel.record(w, a)
            if rec is not None:  # the whole layer in one call, the same bits
                return layer_kernel.run(rec, x, positions, self.rotary, cache, i, vis, self.scale, a.norm_eps)
        T = x.shape[0]
        qkv = w.qkv.matmul(kernels.rmsnorm(x, w.attn_norm, a.norm_eps))
        if a.qk_norm:
            self.norm_qk(qkv, w, kernels.rmsnorm)
        q = kernels.qkv_rope(
            qkv, w.qkv.bias, positions, self.rotary.cos, self.rotary.sin, cache.k[i], cache.v[i], a.n_heads, cache.end
        )
        if plan is not None and plan.attn_split:
            o = yield SplitAttention(i, q, cache.k[i], cache.v[i], vis)
        else:
            o = attend(q, cache.k[i], cache.v[i], vis, self.scale)  # [T, H, D]
        w.attn_out.matmul(o.reshape(T, a.q_dim), out=x)  # x += o W_o^T
        h = kernels.rmsnorm(x, w.ffn_norm, a.norm_eps)
        if self.ffn_inputs is not None:
            self.ffn_inputs.append((i, h))
        if a.moe:
            x += yield from self.moe(i, w, h)
        elif w.flash is not None:  # LLM in a flash: the predicted neurons only (models/flash)
            w.flash(h, x)
        else:
            w.down.matmul(kernels.swiglu(w.gate_up.matmul(h)), out=x)
        return x

    def norm_qk(self, qkv: torch.Tensor, w, norm):
        """RMSNorm of the queries and keys in place (per head, or over the whole projection), before RoPE."""
        a, T = self.args, qkv.shape[0]
        for lo, n, weight in ((0, a.q_dim, w.q_norm), (a.q_dim, a.kv_dim, w.k_norm)):
            part = qkv[:, lo : lo + n]
            width = a.head_dim if a.qk_norm == "head" else n
            part.copy_(norm(part.reshape(-1, width), weight, a.norm_eps).view(T, n))

    def route(self, router, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids [T, k], their weights [T, k]): softmax over the router's logits, top k, renormalised
        where the model does so. Each row on its own (the kernels' property): a token routes the same way
        verified in a tree or decoded alone."""
        a = self.args
        probs = torch.softmax(router.matmul(h), dim=-1)
        top, ids = torch.topk(probs, a.n_experts_used, dim=-1)
        if a.norm_topk:
            top = top / top.sum(-1, keepdim=True)
        return ids, top

    def guess(self, i: int, h: torch.Tensor) -> tuple[int, ...]:
        """Next-router lookahead (mixtral-offloading): the experts layer i+1's router picks for layer i's FFN
        input, by their best routing weight over the rows; () at the last layer or when layer i+1 is not at hand."""
        try:
            router = self.weights.layer(i + 1).router
        except (IndexError, KeyError):
            return ()
        ids, top = self.route(router, h)
        best: dict[int, float] = {}
        for e, p in zip(ids.flatten().tolist(), top.flatten().tolist()):
            best[e] = max(best.get(e, 0.0), p)
        return tuple(sorted(best, key=lambda e: (-best[e], e)))  # the likeliest first: a preload takes the first few

    def moe(self, i: int, w, h: torch.Tensor):
        """A generator: yields `NeedExperts` for the experts the rows of h route to, returns the layer's
        MoE output [T, dim] (each expert on its rows, weighted; plus the shared expert, gated)."""
        ids, top = self.route(w.router, h)
        if self.routes is not None:
            self.routes.append((ids, top, h))
        used = tuple(sorted(set(ids.flatten().tolist())))
        guess = self.guess(i, h) if self.lookahead else ()
        out = torch.zeros_like(h)
        n = self.expert_batch or len(used)  # a buffer that cannot hold the union at once takes it in parts
        for lo in range(0, len(used), n):
            part = used[lo : lo + n]
            experts = yield NeedExperts(i, part, guess)
            tables = [experts[e].table for e in part] if self.fused else [None]
            if all(t is not None for t in tables):  # one kernel call for the part (csrc/experts.cpp)
                kernels.experts(h, ids, top, torch.tensor(part, dtype=torch.int32), torch.stack(tables), out)
                continue
            for e in part:
                rows, k = (ids == e).nonzero(as_tuple=True)
                out.index_add_(
                    0, rows, self.ffn(experts[e].gate_up, experts[e].down, h.index_select(0, rows)) * top[rows, k, None]
                )
        if w.shexp_gate_up is not None:
            out += torch.sigmoid(w.shexp_gate.matmul(h)) * self.ffn(w.shexp_gate_up, w.shexp_down, h)
        return out

    def ffn(self, gate_up, down, h: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return down.matmul(kernels.swiglu(gate_up.matmul(h)))
        gate, up = gate_up(h).chunk(2, dim=-1)
        return down(F.silu(gate) * up)

    @staticmethod
    def _buf(plan: ForwardPlan, k: int, T: int, n: int) -> torch.Tensor:
        return plan.bufs[k][: T * n].view(T, n)

    def block_cols(
        self, i: int, w, x: torch.Tensor, positions: torch.Tensor, cache: KVCache, vis: Visibility, plan: ForwardPlan
    ):
        """`block_fused` with every linear layer handed out as a `SplitColumns` (see `ForwardPlan`):
        x, the inputs of the linears and their outputs live in the plan's shared buffers."""
        a = self.args
        if a.moe or a.qk_norm:
            raise CadenceError(
                f"the sparse worker's column share does not split {a.arch} layers; run without --column-share"
            )
        T = x.shape[0]
        h = kernels.rmsnorm(x, w.attn_norm, a.norm_eps, out=self._buf(plan, 1, T, a.dim))
        qkv = self._buf(plan, 2, T, w.qkv.n)
        yield SplitColumns(i, "qkv", w.qkv, h, qkv, False)
        q = kernels.qkv_rope(
            qkv, w.qkv.bias, positions, self.rotary.cos, self.rotary.sin, cache.k[i], cache.v[i], a.n_heads, cache.end
        )
        if plan.attn_split:
            o = yield SplitAttention(i, q, cache.k[i], cache.v[i], vis)
        else:
            o = attend(q, cache.k[i], cache.v[i], vis, self.scale)
        h = self._buf(plan, 1, T, a.q_dim)
        h.copy_(o.reshape(T, a.q_dim))
        yield SplitColumns(i, "attn_out", w.attn_out, h, x, True)  # x += o W_o^T
        h = kernels.rmsnorm(x, w.ffn_norm, a.norm_eps, out=self._buf(plan, 1, T, a.dim))
        gu = self._buf(plan, 2, T, w.gate_up.n)
        yield SplitColumns(i, "gate_up", w.gate_up, h, gu, False)
        h = kernels.swiglu(gu, out=self._buf(plan, 1, T, w.down.k))
        yield SplitColumns(i, "down", w.down, h, x, True)
        return x

    def block(self, i: int, w, x: torch.Tensor, cos, sin, cache: KVCache, vis: Visibility):
        """The torch-ops layer (devices other than the CPU): a generator like `block_fused`."""
        a = self.args
        T = x.shape[0]
        qkv = w.qkv(rms_norm(x, w.attn_norm, a.norm_eps))
        if a.qk_norm:
            self.norm_qk(qkv, w, rms_norm)
        q, k, v = qkv.split([a.q_dim, a.kv_dim, a.kv_dim], dim=-1)
        q = rope(q.view(T, a.n_heads, a.head_dim), cos, sin)
        k = rope(k.view(T, a.n_kv_heads, a.head_dim), cos, sin)
        cache.write(i, k, v.view(T, a.n_kv_heads, a.head_dim))
        o = attend(q, cache.k[i], cache.v[i], vis, self.scale)  # [T, H, D]
        x = x + w.attn_out(o.reshape(T, a.q_dim))
        h = rms_norm(x, w.ffn_norm, a.norm_eps)
        if self.ffn_inputs is not None:
            self.ffn_inputs.append((i, h))
        if w.flash is not None:
            raise CadenceError("--mode flash runs on cadence's CPU kernels; use --device cpu")
        if a.moe:
            return x + (yield from self.moe(i, w, h))
        return x + self.ffn(w.gate_up, w.down, h)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        vis: Visibility | None = None,
        logits_rows: torch.Tensor | slice | None = None,
        argmax: bool = False,
    ) -> torch.Tensor:
        """tokens, positions [T] -> logits [T', V] fp32 for `logits_rows` (default all rows); V is the
        vocabulary, or the rows a draft's cut head keeps (`head_rows` of its weights: the tokens below it).
        `argmax`: each row's most likely token instead [T'], found head part by head part (no [T', V] tensor).

        The block's keys/values land in cache slots [cache.end, cache.end + T) as pending entries;
        call `cache.commit(keep)` afterwards. `vis` defaults to causal over the whole cache.
        """
        from models.weights import drive

        return drive(self.forward_steps(tokens, positions, cache, vis, logits_rows, argmax=argmax), self.weights)

    def forward_steps(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        vis: Visibility | None = None,
        logits_rows: torch.Tensor | slice | None = None,
        plan: ForwardPlan | None = None,
        argmax: bool = False,
    ):
        """`forward` as a generator of requests (models/plan.py); its return value is the logits.

        It yields a `NeedWeights` for each layer as it reaches it (then for each part of the output head)
        and takes the weights through `send`: a streaming verifier feeds it layers as the loader brings
        them, `forward` feeds it from the weight provider. With a `plan`, it also hands out the split
        parts (`SplitAttention`, `SplitColumns`) and takes their results back.
        """
        T = tokens.shape[0]
        if cache.end + T > cache.capacity:
            raise CadenceError(
                f"the KV cache holds {cache.capacity} tokens and {cache.end + T} are needed; "
                "lower --max-new-tokens or shorten the prompt"
            )
        vis = vis or Visibility.causal(cache.end, T)
        x = self.weights.embed[tokens].float()
        if self.fused:
            self.rotary.ensure(int(positions.max().item()) + 1)
            positions = positions.to(torch.int64).contiguous()
            block = self.block_fused
            if plan is not None and plan.column_share > 0:
                x = self._buf(plan, 0, T, self.args.dim).copy_(x)
                block = self.block_cols
            for i, need in enumerate(self.layer_needs):
                w = yield need
                x = yield from block(i, w, x, positions, cache, vis, plan)
        else:  # torch ops (not the CPU kernels): nothing is split
            cos, sin = self.rotary.tables(positions)
            for i, need in enumerate(self.layer_needs):
                w = yield need
                x = yield from self.block(i, w, x, cos, sin, cache, vis)
        cache.pending += T
        if logits_rows is not None:
            x = x[logits_rows]
        # the output head, part by part (token rows [lo, hi)); a part that is None (a draft that keeps
        # only the frequent tokens' rows) is skipped, and a draft's logits stop at the rows it keeps
        width = getattr(self.weights, "head_rows", None) or self.args.vocab_size
        top = HeadArgmax(x.shape[0], x.device) if argmax else None
        logits = None if argmax else torch.full((x.shape[0], width), float("-inf"), device=x.device)
        h = None
        for need in self.head_needs:
            part = yield need
            if part is None:
                continue
            if h is None:  # head.0 (rows from 0: every head keeps it) carries the final norm
                h = (
                    kernels.rmsnorm(x, part.norm, self.args.norm_eps)
                    if self.fused
                    else rms_norm(x, part.norm, self.args.norm_eps)
                )
            if top is not None:
                top.fold(part.out(h), part.lo)
            else:
                logits[:, part.lo : part.lo + part.out.n] = part.out(h)
        return top.ids if top is not None else logits
