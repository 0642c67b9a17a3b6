"""Our transformer: one decoder block for every family (RMSNorm before and/or after each branch, rotary
embeddings, GQA, q/k norms, SwiGLU or GeGLU, the scales and soft caps a family has: models/args.py),
full-attention or sliding-window layers, dense or a mixture of experts.

`forward` scores a block of new tokens with explicit positions and an explicit visibility
(causal, a token tree, or any mask), writes their keys and values to the cache as pending
entries, and the caller keeps the ones it wants (`KVCache.commit`). Weights come layer by
layer from a provider, so they can be resident or streamed; an MoE layer asks for the experts its
tokens route to once its router has answered (`NeedExperts`), so they can be streamed too.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from common.errors import CadenceError
from models import kernels, layer_kernel
from models.attention import Visibility, attend, chunk_vis
from models.args import ModelArgs
from models.kvcache import KVCache
from models.rope import Rotary, inv_freq
from models import block_parts, mla, moe, recurrent, torch_block
from models.torch_block import rms_norm
from models.sampling import HeadArgmax
from models.requests import ForwardPlan, NeedWeights, SplitAttention, SplitColumns, drive


class Place(NamedTuple):
    """Where layer i's attention works: its cache rows (keys, values [Hkv, rows, D]), the row of the forward's
    first new key, the block's visibility in those rows, and the rotary tables of its kind of layer. A recurrent
    layer's: its rows [rows, width] and state (models/recurrent.py), the global slot of its row 0 (`base`) and the
    slots its state holds (`folded`)."""

    k: torch.Tensor
    v: torch.Tensor | None
    slot0: int
    vis: Visibility
    rotary: Rotary
    base: int = 0
    folded: int = 0
    chains: dict | None = None  # a recurrent layer's state at the end of a long chain it ran (KVCache.chains)
    rec: "Place | None" = None  # an attending layer's recurrent mixer's, where the two run side by side (Falcon-H1)
    ple: torch.Tensor | None = None  # the layer's per-layer embeddings of the forward's rows [T, ple_dim] (Gemma 4)
    spare: Callable | None = (
        None  # a recurrent layer's free state buffer (KVCache.spare), asked for a chain's end state
    )

    def with_ple(self, ple: torch.Tensor) -> "Place":  # (models/block_parts.py)
        return self._replace(ple=ple)


class Transformer:
    def __init__(self, args: ModelArgs, weights, device: str | torch.device = "cpu"):
        self.args, self.weights, self.device = args, weights, torch.device(device)
        self.scale = args.scale
        self.rotaries: dict[tuple[bool, int], Rotary] = {}
        self.rotary = self.rotary_for("full", 0)
        # CPU: the fused row-wise kernels of models/csrc/ops.cpp; elsewhere: torch ops
        self.fused = self.device.type == "cpu" and args.dim % 16 == 0 and args.head_dim <= 1024 and kernels.available()
        self.layer_calls = self.fused  # a dense layer in one kernel call where it can (models/layer_kernel.py)
        # the requests for weights, made once: a forward yields the same ones every time
        self.layer_needs = [NeedWeights(f"layer.{i}", i) for i in range(args.n_layers)]
        self.head_needs = [NeedWeights(g, j) for j, g in enumerate(weights.head_groups)]
        self.lookahead = False  # MoE: guess the next layer's experts with its router (NeedExperts.guess)
        self.expert_batch = 0  # MoE: ask for at most this many experts at once (0: a layer's whole union)
        self.routes: list | None = None  # MoE: when a list, each layer's (expert ids, weights [T, k], input h) appended
        self.kv_dtype = "f32"  # --kv-dtype: its caches' keys and values (models/kvcache.py)
        self.ffn_inputs: list | None = None  # when a list, each layer's (i, FFN input h [T, dim]) is appended
        self._ones: dict[int, torch.Tensor] = {}

    def rotary_for(self, kind: str, capacity: int) -> Rotary:
        """The rotary tables of a kind of layer (`ModelArgs.rope_kind`: "full", "local", "none": zero frequencies,
        cos 1 and sin 0, which rotate nothing); a scaling that depends on the context (LongRoPE, dynamic NTK)
        takes the cache's capacity, as llama.cpp takes its context size."""
        a = self.args
        scaling = a.rope_scaling if kind == "full" else None
        key = (kind, capacity if scaling is not None and scaling.kind in ("longrope", "dynamic") else 0)
        if key not in self.rotaries:
            hd = (a.full_head_dim or a.head_dim) if kind == "full" else a.head_dim  # (Gemma 4's full heads)
            base = a.rope_local_base if kind == "local" else a.rope_base
            none = (torch.zeros(hd // 2), 1.0)  # (NoPE: zero frequencies)
            inv, factor = none if kind == "none" else inv_freq(hd, base, scaling, a.rope_dim, key[1])
            self.rotaries[key] = Rotary(inv, factor, self.device)
        return self.rotaries[key]

    def new_cache(self, capacity: int, storage: torch.Tensor | None = None) -> KVCache:
        if capacity > self.args.context_length:
            raise CadenceError(
                f"{capacity} tokens exceed the model's context of {self.args.context_length}; "
                "shorten the prompt or lower --max-new-tokens"
            )
        return KVCache(self.args, capacity, self.device, storage, self.kv_dtype)

    def places(self, cache: KVCache, vis: Visibility, positions: torch.Tensor) -> list[Place]:
        """Each layer's `Place` for one forward (a sliding layer's visibility computed once for all of them)."""
        a = self.args
        wvis = cache.window_vis(vis, positions) if cache.window else None
        cvis = chunk_vis(vis, positions, a.chunk_size) if a.chunk_layers else None
        need = int(positions.max().item()) + 1
        rotaries = {}
        for kind in {a.rope_kind(i) for i in range(a.n_layers)}:
            rotaries[kind] = self.rotary_for(kind, cache.capacity)
            rotaries[kind].ensure(need)
        out = []
        for i in range(a.n_layers):
            k, v, base = cache.kv(i)
            sliding = a.sliding(i)
            rot = rotaries[a.rope_kind(i)]
            lvis = wvis if sliding else cvis if i in a.chunk_layers else vis
            rec, (kind, j) = None, cache.index[i]
            if i in cache.rec_index:
                rows, state, rbase = cache.rec_kv(cache.rec_index[i])
                spare = functools.partial(cache.spare, cache.rec_index[i])
                rec = Place(rows, state, cache.end - rbase, vis, rot, rbase, cache.folded, cache.chains, spare=spare)
            spare = functools.partial(cache.spare, j) if kind == "rec" else None
            out.append(Place(k, v, cache.end - base, lvis, rot, base, cache.folded, cache.chains, rec, spare=spare))
        return out

    def block_fused(self, i: int, w, x: torch.Tensor, positions: torch.Tensor, at: Place, plan: ForwardPlan | None):
        """A generator (see `forward_steps`): yields a `SplitAttention` when the plan splits attention."""
        a, rec = self.args, None
        if self.layer_calls and self.ffn_inputs is None and (plan is None or not plan.attn_split):
            rec = layer_kernel.record(w, a, i)
            if rec is not None:  # the whole layer in one call (of a layer of experts, its attention), the same bits
                scales = block_parts.query_scales(self, positions, i) if a.attn_temp_beta else None
                layer_kernel.run(rec, x, positions, at, self.scale, a.norm_eps, scales)
                if not a.experts_at(i):
                    return x
        if rec is None:  # (else the kernel ran the layer's mixer, its attention)
            if at.rec is not None:  # both mixers on the layer's one normed input, their outputs added (Falcon-H1)
                h = self.pre(x, w.attn_norm, kernels.rmsnorm)
                h = x.clone() if h is x else h  # (no pre-norm: the mixer adds to x before attention reads it)
                self.mixer(x, w, at.rec, kernels.rmsnorm, h)
                yield from self.attention_fused(i, w, x, positions, at, plan, h)
            elif a.recurrent(i):
                self.mixer(x, w, at, kernels.rmsnorm)
            elif a.mixes(i):
                yield from self.attention_fused(i, w, x, positions, at, plan)
        if not a.has_ffn(i):
            return x
        h = self.pre(x, w.ffn_norm, kernels.rmsnorm)
        end = block_parts.Ending.of(w, a.experts_at(i)) if a.layer_end else None  # (Gemma 4)
        if self.ffn_inputs is not None:
            self.ffn_inputs.append((i, h))
        if a.experts_beside_dense:  # Gemma 4's 26B
            x += yield from moe.beside_dense(self, i, w, x, h, kernels.rmsnorm)
        elif a.experts_at(i):
            x += yield from moe.moe(self, i, w, h)
        elif w.flash is not None:  # LLM in a flash: the predicted neurons only (flash)
            w.flash(h, x)
        else:
            self.residual(x, w.down, self.act(w.gate_up.matmul(h)), w.ffn_post_norm, kernels.rmsnorm)
        return x if end is None else block_parts.finish(self, x, end, at.ple, kernels.rmsnorm)

    def attention_fused(self, i: int, w, x: torch.Tensor, positions: torch.Tensor, at: Place, plan, h=None):
        """The attention branch of `block_fused`, added to x in place (a generator: a plan may split it); `h`: its
        normed input where the caller has it (a mixer beside it shares it)."""
        a, T = self.args, x.shape[0]
        h = self.pre(x, w.attn_norm, kernels.rmsnorm) if h is None else h
        qkv, bias = self.project(w, h, kernels.rmsnorm, i)
        q = self.rotate(qkv, bias, positions, at, i)
        if a.tempered:  # (Llama 4's L2 norms: by `rotate`)
            block_parts.temper(self, q, positions, i, normed=True)
        if plan is not None and plan.attn_split:
            if not a.plain_block():
                raise CadenceError(f"the sparse worker does not split {a.arch}'s attention; run without --partition")
            o = yield SplitAttention(i, q, at.k, at.v, at.vis)
        else:
            o = attend(q, at.k, at.v, at.vis, self.scale, a.attn_softcap, w.attn_sinks)  # [T, H, D]
        self.residual(x, w.attn_out, self.gated(o.reshape(T, -1), w, h), w.attn_post_norm, kernels.rmsnorm)

    def project(self, w, h: torch.Tensor, norm, i: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Layer i's queries, keys and values of its input h [T, q_dim + 2 kv_dim] (its queries alone where it
        shares an earlier layer's keys: Gemma 4), q/k normed where the model norms them, and the bias RoPE's kernel
        is to add (none where the norms took it): one product, or latent attention's (models/mla.py)."""
        if w.mla_kv_a is not None:
            return mla.project(self, w, h, norm), None
        qkv = w.qkv.matmul(h)
        if self.args.qk_norm in ("head", "full"):
            return qkv, self.norm_qk_biased(qkv, w, norm, i)
        return qkv, w.qkv.bias

    def rotate(self, qkv: torch.Tensor, bias, positions: torch.Tensor, at: Place, i: int) -> torch.Tensor:
        """The rotated queries [T, H, D] of layer i's projection; its keys rotated and written to the cache with its
        values. A layer that shares an earlier one's keys (Gemma 4) rotates its queries only."""
        a = self.args
        if a.shares_kv(i):
            cos, sin = at.rotary.tables(positions)
            return torch_block.rope(qkv.view(qkv.shape[0], a.n_heads, -1), cos, sin).contiguous()
        l2 = a.norm_eps if a.l2_at(i) else None  # (Llama 4's norms: after the rotation, before the cache)
        return kernels.qkv_rope(qkv, bias, positions, at.rotary.cos, at.rotary.sin, at.k, at.v, a.n_heads, at.slot0, l2)

    def act(self, gu: torch.Tensor) -> torch.Tensor:
        """The FFN's activation of x W_gate_up on the CPU kernels: SwiGLU, GeGLU, or relu^2 of x W_up (Nemotron-H)."""
        if self.args.act == "relu2":
            return torch.square(F.relu(gu))
        return kernels.glu(gu, self.args.act)

    def pre(self, x: torch.Tensor, weight: torch.Tensor | None, norm) -> torch.Tensor:
        """A branch's input: x through its pre-norm where the layer has one (not OLMo 2's), else x itself."""
        return x if weight is None else norm(x, weight, self.args.norm_eps)

    @staticmethod
    def gated(o: torch.Tensor, w, h: torch.Tensor) -> torch.Tensor:
        """The attention's output [T, q_dim] times sigmoid of its gate projection of the layer's input h, where the
        model has one (Qwen 3.5)."""
        return o if w.attn_gate is None else o * torch.sigmoid(w.attn_gate.matmul(h))

    def mixer(self, x: torch.Tensor, w, at: Place, norm, h: torch.Tensor | None = None) -> None:
        """A recurrent layer's branch (LFM2's convolution, a gated delta-net, Mamba-2) of its normed input `h`
        (default: x through its pre-norm), added to x in place: each row reads its own ancestors' state
        (models/recurrent.py)."""
        h = self.pre(x, w.attn_norm, norm) if h is None else h
        recurrent.MIXERS[self.args.rec_kind](self, x, w, at, norm, h)

    def residual(self, x: torch.Tensor, out, h: torch.Tensor, post: torch.Tensor | None, norm):
        """x += h W^T, through the branch's norm (Gemma, OLMo 2) and scale (Granite) where the model has them."""
        a = self.args
        if post is None and a.residual_scale == 1.0 and out.bias is None:
            out.matmul(h, out=x)  # added in place
            return
        y = out(h)  # with its bias (gpt-oss's attention output)
        if post is not None:
            y = norm(y, post, a.norm_eps)
        if a.residual_scale != 1.0:
            y = y * a.residual_scale
        x += y

    def norm_qk_biased(self, qkv: torch.Tensor, w, norm, i: int = 0) -> None:
        """`norm_qk` of the projection with its bias added first (GLM-4.5: the norm sees the biased q and k); the
        bias left for RoPE's kernel to add: none."""
        if w.qkv.bias is not None:
            qkv += w.qkv.bias
        self.norm_qk(qkv, w, norm, i)

    def norm_qk(self, qkv: torch.Tensor, w, norm, i: int = 0):
        """RMSNorm of layer i's queries and keys in place (per head, or over the whole projection), before RoPE;
        of its values too, without a weight, where the model norms them (Gemma 4)."""
        a, T = self.args, qkv.shape[0]
        hd, q_dim = a.head_dim_at(i), a.q_dim_at(i)
        kv_dim = 0 if a.shares_kv(i) else a.kv_dim_at(i)
        parts = [(0, q_dim, w.q_norm)] + [(q_dim, kv_dim, w.k_norm)] * bool(kv_dim)
        if a.v_norm and kv_dim:
            parts.append((q_dim + kv_dim, kv_dim, self.ones(hd)))
        for lo, n, weight in parts:
            part = qkv[:, lo : lo + n]
            width = hd if a.qk_norm == "head" else n
            part.copy_(norm(part.reshape(-1, width), weight, a.norm_eps).view(T, n))

    def ones(self, n: int) -> torch.Tensor:
        """A weight of n ones (a norm without a weight of its own), made once."""
        if n not in self._ones:
            self._ones[n] = torch.ones(n, device=self.device)
        return self._ones[n]

    @staticmethod
    def _buf(plan: ForwardPlan, k: int, T: int, n: int) -> torch.Tensor:
        return plan.bufs[k][: T * n].view(T, n)

    def block_cols(self, i: int, w, x: torch.Tensor, positions: torch.Tensor, at: Place, plan: ForwardPlan):
        """`block_fused` with every linear layer handed out as a `SplitColumns` (see `ForwardPlan`):
        x, the inputs of the linears and their outputs live in the plan's shared buffers."""
        a = self.args
        if a.moe or a.qk_norm or not a.plain_block():
            raise CadenceError(
                f"the sparse worker's column share does not split {a.arch} layers; run without --column-share"
            )
        T = x.shape[0]
        h = kernels.rmsnorm(x, w.attn_norm, a.norm_eps, out=self._buf(plan, 1, T, a.dim))
        qkv = self._buf(plan, 2, T, w.qkv.n)
        yield SplitColumns(i, "qkv", w.qkv, h, qkv, False)
        q = kernels.qkv_rope(qkv, w.qkv.bias, positions, at.rotary.cos, at.rotary.sin, at.k, at.v, a.n_heads, at.slot0)
        if plan.attn_split:
            o = yield SplitAttention(i, q, at.k, at.v, at.vis)
        else:
            o = attend(q, at.k, at.v, at.vis, self.scale)
        h = self._buf(plan, 1, T, a.q_dim)
        h.copy_(o.reshape(T, a.q_dim))
        yield SplitColumns(i, "attn_out", w.attn_out, h, x, True)  # x += o W_o^T
        h = kernels.rmsnorm(x, w.ffn_norm, a.norm_eps, out=self._buf(plan, 1, T, a.dim))
        gu = self._buf(plan, 2, T, w.gate_up.n)
        yield SplitColumns(i, "gate_up", w.gate_up, h, gu, False)
        h = kernels.swiglu(gu, out=self._buf(plan, 1, T, w.down.k))
        yield SplitColumns(i, "down", w.down, h, x, True)
        return x

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
        """`forward` as a generator of requests (models/requests.py); its return value is the logits.

        It yields a `NeedWeights` for each layer as it reaches it (then for each part of the output head)
        and takes the weights through `send`: a streaming verifier feeds it layers as the loader brings
        them, `forward` feeds it from the weight provider. With a `plan`, it also hands out the split
        parts (`SplitAttention`, `SplitColumns`) and takes their results back.
        """
        a, T = self.args, tokens.shape[0]
        cache.reserve(positions)
        vis = vis or Visibility.causal(cache.end, T)
        x = self.weights.embed[tokens].float()
        if a.embed_scale != 1.0:
            x = x * a.embed_scale
        places = self.places(cache, vis, positions)
        if self.fused:
            positions = positions.to(torch.int64).contiguous()
            block = self.block_fused
            if plan is not None and plan.column_share > 0:
                x = self._buf(plan, 0, T, a.dim).copy_(x)
                block = self.block_cols
            for i, need in enumerate(self.layer_needs):
                w = yield need
                places = (
                    block_parts.with_ple(self, places, tokens, x, w, kernels.rmsnorm)
                    if i == 0 and a.ple_dim
                    else places
                )
                x = yield from block(i, w, x, positions, places[i], plan)
        else:  # torch ops (not the CPU kernels): nothing is split
            for i, need in enumerate(self.layer_needs):
                w = yield need
                places = block_parts.with_ple(self, places, tokens, x, w, rms_norm) if i == 0 and a.ple_dim else places
                x = yield from torch_block.block(self, i, w, x, positions, places[i])
        cache.pending += T
        if logits_rows is not None:
            x = x[logits_rows]
        return (yield from self.head_steps(x, argmax))

    def head_steps(self, x: torch.Tensor, argmax: bool):
        """The output head, part by part (token rows [lo, hi)); a part that is None (a draft that keeps only the
        frequent tokens' rows) is skipped, and a draft's logits stop at the rows it keeps."""
        a = self.args
        width = getattr(self.weights, "head_rows", None) or a.vocab_size
        plain = self.fused and not a.final_softcap  # (a part's logits as the kernel gives them)
        top = HeadArgmax(x.shape[0], x.device, plain, a.logits_div) if argmax else None
        logits = None if argmax else torch.full((x.shape[0], width), float("-inf"), device=x.device)
        h, stays = None, getattr(self.weights, "is_resident", lambda need: True)
        for need in self.head_needs:
            part = yield need
            if part is None:
                continue
            if h is None:  # head.0 (rows from 0: every head keeps it) carries the final norm
                h = (kernels.rmsnorm if self.fused else rms_norm)(x, part.norm, a.norm_eps)
            if top is not None and top.hold(part, stays(need), h):  # resident parts: folded together, in one call
                continue
            y = part.out(h)
            if a.logits_div != 1.0:  # Granite
                y = y / a.logits_div
            if a.final_softcap:  # Gemma 2: as transformers does it, so near ties break the same way
                y = torch.tanh(y / a.final_softcap) * a.final_softcap
            if top is not None:
                top.fold(y, part.lo)
            else:
                logits[:, part.lo : part.lo + part.out.n] = y
        return top.flush(h) if top is not None else logits
