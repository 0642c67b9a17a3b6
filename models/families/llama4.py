"""Llama 4 (text; Scout, Maverick): rotating layers with chunked attention (a query sees its own chunk of
`attention_chunk_size` positions) and a weightless L2 norm of q and k after RoPE (`use_qk_norm`), interleaved rotary
pairs; every fourth layer NoPE, global, its queries scaled by 1 + attn_scale ln(1 + floor((pos + 1) / floor_scale));
mixtures of experts on `moe_layers` (top-1 by sigmoid, the weight scaling the expert's input) beside an ungated
shared expert, dense layers of `intermediate_size_mlp` between. The released checkpoints wrap it with a vision model
(`language_model.model.*`): cadence runs the text model."""

from __future__ import annotations

from models.families.base import MOE_HF_KEYS, Family

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


LLAMA4 = Family(
    "llama4",
    hf_types=("llama4_text",),
    gguf_archs=(),
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
