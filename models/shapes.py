"""Shapes: what a model's config implies, layer by layer: each layer's head size and count (Gemma 4's full layers
have their own), its FFN's width, which earlier layer's keys and values it attends over, a recurrent layer's rows and
state, and the bytes of the KV cache for a context. `ModelArgs` (models/args.py) is a `Shapes`."""

from __future__ import annotations

import math

from common.errors import CadenceError
from common.settings import PREFILL_CHUNK

# committed rows a sliding-window layer keeps past its window (models/kvcache.py): a rewind by up to this many works
WINDOW_REWIND = 64
KV_DTYPES = ("f32", "f16", "q8")  # --kv-dtype: a key's or value's element (models/kvcache.py)
Q8_BLOCK, Q8_BYTES = 32, 34  # q8 as llama.cpp's q8_0: blocks of 32 int8 with a half scale ahead of them


def kv_row_bytes(d: int, dtype: str) -> int:
    """Bytes of a key or value row of `d` elements in a cache of `dtype`."""
    if dtype == "q8":
        if d % Q8_BLOCK:
            raise CadenceError(
                f"--kv-dtype q8 keeps a head's keys in blocks of {Q8_BLOCK}, and this model's heads are {d} wide; "
                "use --kv-dtype f16"
            )
        return d // Q8_BLOCK * Q8_BYTES
    return d * {"f32": 4, "f16": 2}[dtype]


class Shapes:
    """Methods over `ModelArgs`' fields (see there)."""

    @property
    def tempered(self) -> bool:
        """Queries scaled by position or L2-normed (Ministral 3, Llama 4: models/block_parts.py `temper`)."""
        return bool(self.attn_temp_beta) or self.qk_norm == "l2"

    def l2_at(self, layer: int) -> bool:
        """The layer's rotated queries and keys are L2-normed (Llama 4's layers with rope)."""
        return self.qk_norm == "l2" and layer not in self.nope_layers

    @property
    def layer_end(self) -> bool:
        """A layer ends with a per-layer embedding's branch or a scalar (Gemma 4: models/block_parts.py `finish`)."""
        return bool(self.ple_dim) or self.layer_scale

    @property
    def gdn_conv_dim(self) -> int:
        """Channels a gated delta-net convolves: q, k (k heads x k dim each) and v (v heads x v dim)."""
        return 2 * self.gdn_k_heads * self.gdn_k_dim + self.gdn_v_heads * self.gdn_v_dim

    @property
    def rec_width(self) -> int:
        """Floats a recurrent layer keeps per recent token (models/recurrent.py): a convolution's input row; a gated
        delta-net's too, then its k, v, decay and beta for the state's replay."""
        if self.conv_layers:
            return self.dim
        if self.gdn_layers:
            return self.gdn_conv_dim + self.gdn_k_heads * self.gdn_k_dim + self.gdn_v_heads * (self.gdn_v_dim + 2)
        if self.ssm_layers:  # its convolution's input, then x and B after it, the step dt and its decay exp(dt A)
            return self.ssm_conv_dim + self.ssm_inner + self.ssm_groups * self.ssm_state + 2 * self.ssm_heads
        return 0

    @property
    def rec_state(self) -> tuple[int, ...]:
        """The shape of a recurrent layer's state besides its rows: a gated delta-net's [v heads, k dim, v dim]."""
        if self.ssm_layers:
            return (self.ssm_heads, self.ssm_head_dim, self.ssm_state)
        return (self.gdn_v_heads, self.gdn_k_dim, self.gdn_v_dim) if self.gdn_layers else (0,)

    def rec_rows(self, capacity: int) -> int:
        """Recent tokens a recurrent layer keeps rows for: the kernel's reach back, what a rewind within the
        pending rows needs, and a forward's new rows."""
        return min(capacity, self.conv_kernel - 1 + WINDOW_REWIND + PREFILL_CHUNK) if self.rec_layers else 0

    def head_dim_at(self, layer: int) -> int:
        """A layer's head size: a full-attention layer's own where the model gives one (Gemma 4)."""
        return self.full_head_dim if self.full_head_dim and not self.sliding(layer) else self.head_dim

    def kv_heads_at(self, layer: int) -> int:
        return self.full_kv_heads if self.full_kv_heads and not self.sliding(layer) else self.n_kv_heads

    def q_dim_at(self, layer: int) -> int:
        return self.n_heads * self.head_dim_at(layer)

    def kv_dim_at(self, layer: int) -> int:
        return self.kv_heads_at(layer) * self.head_dim_at(layer)

    def ffn_dim_at(self, layer: int) -> int:
        return self.ffn_dim * (2 if self.wide_shared_ffn and self.shares_kv(layer) else 1)

    def shares_kv(self, layer: int) -> bool:
        """The layer attends over an earlier layer's keys and values and makes none (Gemma 4's last layers)."""
        return layer >= self.n_layers - self.kv_shared

    def kv_source(self, layer: int) -> int | None:
        """The layer whose keys and values a layer attends over: itself, or for a sharing layer the last layer of
        its kind (sliding or full) before the sharing ones (None: there is none)."""
        if not self.shares_kv(layer):
            return layer
        first = self.n_layers - self.kv_shared
        return next((j for j in range(first - 1, -1, -1) if self.sliding(j) == self.sliding(layer)), None)

    @property
    def n_sliding(self) -> int:
        """Sliding-window layers with a cache of their own."""
        return sum(not self.shares_kv(i) for i in self.sliding_layers)

    def window_rows(self, capacity: int) -> int:
        """Cache rows a sliding layer holds for a context of `capacity` (models/kvcache.py): the window, what a
        rewind may need, and a forward's new rows (a prefill chunk, a tree)."""
        if not self.sliding_layers:
            return 0
        return min(capacity, self.sliding_window - 1 + WINDOW_REWIND + PREFILL_CHUNK)

    def kv_bytes(self, capacity: int, dtype: str = "f32") -> int:
        """Bytes of the KV cache for a context of `capacity` tokens, its keys and values of `dtype` (--kv-dtype): a
        sliding layer keeps its window only; a recurrent layer its state and its recent tokens' rows
        (models/recurrent.py), in float32 whatever the keys' dtype."""
        heads, d = self.full_kv_heads or self.n_kv_heads, self.full_head_dim or self.head_dim
        kv = 2 * self.n_full * capacity * heads * kv_row_bytes(d, dtype) if self.n_full else 0
        if self.n_sliding:
            kv += 2 * self.n_sliding * self.window_rows(capacity) * self.n_kv_heads * kv_row_bytes(self.head_dim, dtype)
        rec = len(self.rec_layers) * (self.rec_rows(capacity) * self.rec_width + math.prod(self.rec_state))
        return kv + rec * 4  # (a pair of rows of any dtype is a multiple of 4 bytes)


def tensor_shape(args: "Shapes", name: str) -> tuple[int, ...]:
    """The shape of a canonical tensor ([out, in] for weights)."""
    a = args
    if name in ("embed", "head"):
        return (a.vocab_size, a.dim)
    if name == "embed_pl":
        return (a.ple_vocab, a.n_layers * a.ple_dim)
    part = name.rsplit(".", 1)[-1]
    i = int(name.split(".")[1]) if name.startswith("blk.") else 0
    q_dim, kv_dim, ffn = a.q_dim_at(i), 0 if a.shares_kv(i) else a.kv_dim_at(i), a.ffn_dim_at(i)
    qkv = q_dim + 2 * kv_dim
    norm_width = {"head": a.head_dim_at(i), "full": None}.get(a.qk_norm)
    return {
        "attn_norm": (a.dim,),
        "ffn_norm": (a.dim,),
        "attn_post_norm": (a.dim,),
        "ffn_post_norm": (a.dim,),
        "out_norm": (a.dim,),
        "attn_qkv": (qkv, a.dim),
        "attn_qkv_bias": (qkv,),
        "attn_out": (a.dim, q_dim),
        "ffn_gate_up": ((1 if a.act == "relu2" else 2) * ffn, a.dim),
        "ffn_down": (a.dim, ffn),
        "attn_q_norm": (norm_width or q_dim,),
        "attn_k_norm": (norm_width or kv_dim,),
        "ple_proj": (a.n_layers * a.ple_dim, a.dim),
        "ple_proj_norm": (a.ple_dim,),
        "ple_gate": (a.ple_dim, a.dim),
        "ple_out": (a.dim, a.ple_dim),
        "ple_post_norm": (a.dim,),
        "layer_scale": (1,),
        "ffn_post_norm_1": (a.dim,),
        "ffn_norm_2": (a.dim,),
        "ffn_post_norm_2": (a.dim,),
        "ffn_router_scale": (a.dim,),
        "ffn_expert_scale": (a.n_experts,),
        "ffn_router": (a.n_experts, a.dim),
        "ffn_shexp_gate": (1, a.dim),
        "ffn_shexp_gate_up": (2 * a.shared_ffn_dim, a.dim),
        "ffn_shexp_down": (a.dim, a.shared_ffn_dim),
        "gate_up": (2 * a.expert_ffn_dim, a.dim),
        "down": (a.dim, a.expert_ffn_dim),
        "conv_in": (3 * a.dim, a.dim),
        "conv_w": (a.dim, a.conv_kernel),
        "conv_out": (a.dim, a.dim),
        "attn_gate": (a.q_dim, a.dim),
        "gdn_in": (a.gdn_conv_dim + a.gdn_v_heads * (a.gdn_v_dim + 2), a.dim),
        "gdn_conv": (a.gdn_conv_dim, a.conv_kernel),
        "gdn_dt": (a.gdn_v_heads,),
        "gdn_a": (a.gdn_v_heads,),
        "gdn_norm": (a.gdn_v_dim,),
        "gdn_out": (a.dim, a.gdn_v_heads * a.gdn_v_dim),
        "ssm_in": (a.ssm_inner + a.ssm_conv_dim + a.ssm_heads, a.dim),
        "ssm_conv": (a.ssm_conv_dim, a.conv_kernel),
        "ssm_conv_b": (a.ssm_conv_dim,),
        "ssm_dt": (a.ssm_heads,),
        "ssm_a": (a.ssm_heads,),
        "ssm_d": (a.ssm_heads,),
        "ssm_norm": (a.ssm_inner,),
        "ssm_out": (a.dim, a.ssm_inner),
        "attn_sinks": (a.n_heads,),
        "attn_q_a": (a.mla_q_rank, a.dim),
        "attn_q_a_norm": (a.mla_q_rank,),
        "attn_q": (a.q_dim, a.mla_q_rank or a.dim),
        "attn_kv_a": (a.mla_kv_rank + a.rope_dim, a.dim),
        "attn_kv_a_norm": (a.mla_kv_rank,),
        "attn_kv_b": (a.n_heads * (2 * a.head_dim - a.rope_dim), a.mla_kv_rank),
        "attn_out_bias": (a.dim,),
        "ffn_router_bias": (a.n_experts,),
        "ffn_router_sel": (a.n_experts,),
        "gate_up_bias": (2 * a.expert_ffn_dim,),
        "down_bias": (a.dim,),
    }[part]
