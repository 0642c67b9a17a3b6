"""Llama (2 and 3.x, with its rope scaling), Mistral (a sliding window on every layer where its config gives
one), Granite (Llama's block with four multipliers), Mixtral (Llama's attention, a mixture of experts),
Seed-OSS (Llama's block with q/k/v biases and an explicit head size) and Ministral 3 (Mistral's block with YaRN
and its queries scaled by position after RoPE, as Llama 4's are). llama.cpp writes Llama, Mistral and Mixtral
as its `llama` architecture, with q/k rows in its interleaved rotary order."""

from __future__ import annotations

from models.families.base import MOE_HF_KEYS, Family, Unsupported, windowed


def _every_layer(window, args: dict) -> dict:
    return windowed(window, tuple(range(args["n_layers"])), args["context_length"])


LLAMA = Family(
    "llama",
    hf_types=("llama",),
    gguf_archs=("llama",),
    # transformers' Llama has no sliding window: a `sliding_window` in its config changes nothing there
    gguf_keys=frozenset({"attention.sliding_window"}),
    gguf_fields=lambda key, a: _every_layer(key("attention.sliding_window", 0), a),
    gguf_permuted=True,
)

MISTRAL = Family(
    "mistral",
    hf_types=("mistral",),
    gguf_archs=(),  # llama.cpp writes Mistral as `llama`
    hf_defaults={"sliding_window": 4096, "rope_theta": 10000.0},
    hf_fields=lambda cfg, a: _every_layer(cfg["sliding_window"], a),
)

_GRANITE_KEYS = {
    "embedding_multiplier": "embed_scale",
    "attention_multiplier": "attn_scale",
    "residual_multiplier": "residual_scale",
    "logits_scaling": "logits_div",
}
GRANITE_GGUF = {
    "embedding_scale": "embed_scale",
    "attention.scale": "attn_scale",
    "residual_scale": "residual_scale",
    "logit_scale": "logits_div",
}

GRANITE = Family(
    "granite",
    hf_types=("granite",),
    gguf_archs=("granite",),
    hf_defaults={k: 1.0 for k in _GRANITE_KEYS},
    hf_keys=frozenset(_GRANITE_KEYS),
    hf_fields=lambda cfg, a: {f: float(cfg[k]) for k, f in _GRANITE_KEYS.items()},
    gguf_keys=frozenset(GRANITE_GGUF),
    gguf_fields=lambda key, a: {f: float(key(k, 1.0)) for k, f in GRANITE_GGUF.items()},
    gguf_permuted=True,
)

MIXTRAL = Family(
    "mixtral",
    hf_types=("mixtral",),
    gguf_archs=(),  # llama.cpp writes Mixtral as `llama` with expert tensors
    block={"norm_topk": True},
    hf_defaults={"rope_theta": 1e6, "rms_norm_eps": 1e-5, "sliding_window": None},
    hf_keys=MOE_HF_KEYS,
    hf_fields=lambda cfg, a: _every_layer(cfg["sliding_window"], a),
    gguf_keys=frozenset({"attention.sliding_window"}),
    gguf_fields=lambda key, a: _every_layer(key("attention.sliding_window", 0), a),
    gguf_permuted=True,
)


def _seed_oss(cfg: dict, a: dict) -> dict:
    if cfg.get("attention_out_bias"):
        raise Unsupported("attention_out_bias: true (a bias on the attention's output projection)")
    return {}


SEED_OSS = Family(
    "seed_oss",
    hf_types=("seed_oss",),
    gguf_archs=("seed_oss",),
    hf_defaults={"rope_theta": 10000.0, "head_dim": 128},
    hf_keys=frozenset({"attention_out_bias", "residual_dropout"}),
    hf_fields=_seed_oss,
    gguf_names={"ffn_norm": ("post_attention_norm",)},  # llama.cpp's name for Seed-OSS's pre-FFN norm
)


def _ministral3(cfg: dict, a: dict) -> dict:
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    beta = float(rope.get("llama_4_scaling_beta") or 0.0)
    temp = {"attn_temp_beta": beta, "attn_temp_scale": float(rope["original_max_position_embeddings"])} if beta else {}
    return {**_every_layer(cfg.get("sliding_window"), a), **temp}


def _ministral3_gguf(key, a: dict) -> dict:
    """llama.cpp's mistral3: the position scaling as `attention.temperature_scale` over the YaRN original context."""
    beta = float(key("attention.temperature_scale", 0.0) or 0.0)
    temp = {}
    if beta:
        temp = {"attn_temp_beta": beta, "attn_temp_scale": float(key("rope.scaling.original_context_length"))}
    return {**_every_layer(key("attention.sliding_window", 0), a), **temp}


MINISTRAL3 = Family(
    "ministral3",
    hf_types=("ministral3",),
    gguf_archs=("mistral3",),
    hf_defaults={"sliding_window": None},
    hf_fields=_ministral3,
    gguf_keys=frozenset({"attention.sliding_window", "attention.temperature_scale"}),
    gguf_fields=_ministral3_gguf,
    gguf_permuted=True,
)
