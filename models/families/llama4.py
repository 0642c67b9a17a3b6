"""Llama 4 (text; Scout, Maverick): rotating layers with chunked attention (a query sees its own chunk of
`attention_chunk_size` positions) and a weightless L2 norm of q and k after RoPE (`use_qk_norm`), interleaved rotary
pairs; every fourth layer NoPE, global, its queries scaled by 1 + attn_scale ln(1 + floor((pos + 1) / floor_scale));
mixtures of experts on `moe_layers` (top-1 by sigmoid, the weight scaling the expert's input) beside an ungated
shared expert, dense layers of `intermediate_size_mlp` between. The released checkpoints wrap it with a vision model
(`language_model.model.*`): cadence runs the text model.

llama.cpp's `llama4` GGUF (its converter's Llama4Model) keeps q/k as they are (its NORM rope rotates the same
interleaved pairs), splits the fused experts' gate_up in halves and says little in keys: `interleave_moe_layer_step`
places the experts, the experts' and the dense FFN's widths; the rest llama.cpp fixes for every Llama 4 GGUF, so
the reader does too: chunks of 8192 on three layers in four (or `attention.sliding_window_pattern`), every fourth
layer NoPE with its queries tempered by 0.1 ln(1 + floor((pos + 1) / 8192)), L2 q/k norms unless 128 experts
(Maverick, released without them)."""

from __future__ import annotations

from common.errors import CadenceError
from models.families.base import MOE_HF_KEYS, Family, gguf_pattern

_KEYS = MOE_HF_KEYS | frozenset(
    "intermediate_size_mlp moe_layers interleave_moe_layer_step use_qk_norm no_rope_layers no_rope_layer_interval "
    "attention_chunk_size attn_temperature_tuning floor_scale attn_scale".split()
)


def _hf(cfg: dict, a: dict) -> dict:
    n = a["n_layers"]
    every = int(cfg.get("no_rope_layer_interval") or 4)
    rotates = cfg.get("no_rope_layers") or [int((i + 1) % every != 0) for i in range(n)]
    nope = tuple(i for i in range(n) if not rotates[i])
    chunk = int(cfg.get("attention_chunk_size") or 0)
    types = cfg.get("layer_types") or ["chunked_attention" if r and chunk else "full_attention" for r in rotates]
    step = int(cfg.get("interleave_moe_layer_step") or 1)
    moe = cfg.get("moe_layers")
    moe = set(moe if moe is not None else range(step - 1, n, step))
    temp = {}
    if cfg.get("attn_temperature_tuning", True):
        temp = dict(
            attn_temp_beta=float(cfg.get("attn_scale") or 0.1),
            attn_temp_scale=float(cfg.get("floor_scale") or 8192),
            attn_temp_offset=1,
            attn_temp_layers=nope,
        )
    return {
        **temp,
        "nope_layers": nope,
        "chunk_size": chunk,
        "chunk_layers": tuple(i for i, t in enumerate(types) if t == "chunked_attention"),
        "qk_norm": "l2" if cfg.get("use_qk_norm", True) else "",
        "ffn_dim": int(cfg.get("intermediate_size_mlp") or cfg["intermediate_size"]),
        "dense_layers": tuple(i for i in range(n) if i not in moe),
        "router_sigmoid": True,
        "router_scales_input": True,
        "norm_topk": False,
        "shared_ffn_dim": int(cfg["intermediate_size"]),
        "shared_gated": False,
    }


def _gguf(key, a: dict) -> dict:
    """llama.cpp's llama4 (src/models/llama4.cpp): the experts on every `interleave_moe_layer_step`-th layer, and its
    fixed chunks, NoPE layers, temperature and q/k norms."""
    if key("interleave_moe_layer_step") is None or not key("expert_count"):
        raise CadenceError("a llama4 GGUF without expert_count or interleave_moe_layer_step (its experts) is not run")
    if key("attention.sliding_window", None) == 0:  # llama.cpp: MobileLLM's, its last layer unrotated and untempered
        raise CadenceError("a llama4 GGUF with attention.sliding_window 0 (no chunked attention) is not run yet")
    n, step = a["n_layers"], int(key("interleave_moe_layer_step"))
    nope = tuple(i for i in range(n) if (i + 1) % 4 == 0)
    return {
        "nope_layers": nope,
        "chunk_size": 8192,
        "chunk_layers": gguf_pattern(key, n, 4),
        "attn_temp_beta": 0.1,
        "attn_temp_scale": 8192.0,
        "attn_temp_offset": 1,
        "attn_temp_layers": nope,
        "qk_norm": "" if int(key("expert_count")) == 128 else "l2",
        "dense_layers": tuple(i for i in range(n) if not (step > 0 and (i + 1) % step == 0)),
        "router_sigmoid": True,
        "router_scales_input": True,
        "norm_topk": False,
        "shared_gated": False,
    }


LLAMA4 = Family(
    "llama4",
    hf_types=("llama4_text",),
    gguf_archs=("llama4",),
    gguf_keys=frozenset(
        "vocab_size interleave_moe_layer_step attention.sliding_window attention.sliding_window_pattern".split()
    ),
    gguf_fields=_gguf,
    hf_defaults={"rope_theta": 500000.0},
    hf_keys=_KEYS,
    hf_fields=_hf,
    hf_names={
        "ffn_router": ("feed_forward.router",),
        "ffn_gate_up": ("feed_forward.gate_proj", "feed_forward.up_proj"),
        "ffn_down": ("feed_forward.down_proj",),
        "ffn_shexp_gate_up": ("feed_forward.shared_expert.gate_proj", "feed_forward.shared_expert.up_proj"),
        "ffn_shexp_down": ("feed_forward.shared_expert.down_proj",),
    },
    hf_moe_prefix="feed_forward",
    experts_xw="halves",
    interleaved=True,
)
