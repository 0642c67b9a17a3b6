"""gpt-oss (OpenAI): attention with q/k/v and output biases and a learned sink logit per head in every softmax
(models/attention.py `attend`), sliding-window layers (128) alternating with full ones, YaRN without truncation;
a mixture of experts whose router (with a bias) softmaxes its top k logits, and whose experts have biases and a
clamped SwiGLU, (up + 1) * gate * sigmoid(1.702 gate). The released checkpoints keep the experts in MXFP4 blocks
(dequantized as read: formats/source_hf.py `mxfp4`), fused [experts, in, out] with gate and up interleaved. From
llama.cpp's GGUF (`gpt-oss`; bench/hf_gguf_gptoss.py writes one as its converter does): the experts split into gate
and up, in MXFP4 blocks gguf dequantizes; every other layer sliding, the first among them; YaRN untruncated, as the
model was trained (a GGUF does not say)."""

from __future__ import annotations

import dataclasses

from models.families.base import MOE_HF_KEYS, Family, Unsupported, layer_kinds, windowed


def _hf(cfg: dict, a: dict) -> dict:
    if cfg.get("hidden_act", "silu") != "silu":
        raise Unsupported(f"hidden_act {cfg['hidden_act']!r}")
    sliding = layer_kinds(cfg, a["n_layers"], lambda i: i % 2 == 0)
    return {
        **windowed(cfg.get("sliding_window"), sliding, a["context_length"]),
        "norm_topk": False,
        "swiglu_limit": float(cfg.get("swiglu_limit") or 7.0),
        "swiglu_alpha": float(cfg.get("swiglu_alpha") or 1.702),
    }


def _gguf(key, a: dict) -> dict:
    """llama.cpp's gpt-oss: its window on the even layers (`set_swa_pattern(2)`), the clamp and slope it hard-codes,
    YaRN untruncated."""
    rope = a.get("rope_scaling")
    return {
        **windowed(key("attention.sliding_window"), tuple(range(0, a["n_layers"], 2)), a["context_length"]),
        "norm_topk": False,
        "swiglu_limit": 7.0,
        "swiglu_alpha": 1.702,
        **({"rope_scaling": dataclasses.replace(rope, truncate=False)} if rope and rope.kind == "yarn" else {}),
    }


GPT_OSS = Family(
    "gpt_oss",
    hf_types=("gpt_oss",),
    gguf_archs=("gpt-oss",),
    gguf_keys=frozenset({"attention.sliding_window", "expert_feed_forward_length"}),
    gguf_fields=_gguf,
    gguf_names={
        "ffn_norm": ("post_attention_norm",),
        "attn_sinks": ("attn_sinks",),
        "attn_out_bias": ("attn_output.bias",),
        "ffn_router": ("ffn_gate_inp",),
        "ffn_router_bias": ("ffn_gate_inp.bias",),
    },
    gguf_params=frozenset({"attn_out_bias", "ffn_router_bias"}),
    block={
        "attn_sinks": True,
        "attn_out_bias": True,
        "router_bias": True,
        "router_topk_first": True,
        "expert_bias": True,
    },
    hf_defaults={"rope_theta": 150000.0, "rms_norm_eps": 1e-5, "sliding_window": 128},
    hf_keys=MOE_HF_KEYS | frozenset({"swiglu_alpha", "swiglu_limit"}),
    hf_fields=_hf,
    hf_names={
        "ffn_router": ("mlp.router",),
        "attn_sinks": ("self_attn.sinks",),
        "attn_out_bias": ("self_attn.o_proj.bias",),
        "ffn_router_bias": ("mlp.router.bias",),
    },
    hf_params=frozenset({"attn_sinks", "attn_out_bias", "ffn_router_bias"}),
    experts_xw="interleaved",
)
