"""Gemma 2 and Gemma 3: a norm before and after both the attention and the FFN, norms applied as `1 + w`
(an HF directory stores w; llama.cpp's converter stores 1 + w), GeGLU with tanh gelu, embeddings scaled by
sqrt(dim), the attention scaled by `query_pre_attn_scalar ** -0.5`, sliding-window layers among full ones.
Gemma 2 soft-caps the attention scores and the logits; Gemma 3 has q/k norms instead, and its sliding layers
rotate with a base of their own (`rope_local_base_freq`), unscaled."""

from __future__ import annotations

from models.families.base import SLIDING, Family, Unsupported, gguf_pattern, hf_rope, layer_kinds, windowed

_NAMES_HF = {
    "attn_post_norm": ("post_attention_layernorm",),
    "ffn_norm": ("pre_feedforward_layernorm",),
    "ffn_post_norm": ("post_feedforward_layernorm",),
}
_BLOCK = {"post_norm": True, "act": "gelu_tanh"}
_KEYS = frozenset(
    "query_pre_attn_scalar final_logit_softcapping attn_logit_softcapping hidden_activation "
    "use_bidirectional_attention".split()
)


def _scales(cfg: dict, a: dict) -> dict:
    if cfg.get("use_bidirectional_attention"):
        raise Unsupported("use_bidirectional_attention: an encoder (EmbeddingGemma), not a causal decoder")
    if cfg["hidden_activation"] not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise Unsupported(f"hidden_activation {cfg['hidden_activation']!r} (cadence runs gelu_pytorch_tanh)")
    return {
        "embed_scale": a["dim"] ** 0.5,
        "attn_scale": float(cfg["query_pre_attn_scalar"]) ** -0.5,
        "attn_softcap": float(cfg.get("attn_logit_softcapping") or 0.0),
        "final_softcap": float(cfg.get("final_logit_softcapping") or 0.0),
    }


def _gemma2_hf(cfg: dict, a: dict) -> dict:
    sliding = layer_kinds(cfg, a["n_layers"], lambda i: i % 2 == 0)
    return {**_scales(cfg, a), **windowed(cfg["sliding_window"], sliding, a["context_length"])}


def _gemma3_hf(cfg: dict, a: dict) -> dict:
    pattern = int(cfg.get("sliding_window_pattern") or 6)
    sliding = layer_kinds(cfg, a["n_layers"], lambda i: bool((i + 1) % pattern))
    local_base, local_scaling, _ = hf_rope(cfg, a["head_dim"], SLIDING)
    if local_scaling is not None:
        raise Unsupported(f"rope scaling '{local_scaling.kind}' on the sliding layers (cadence scales full ones)")
    return {**_scales(cfg, a), **windowed(cfg["sliding_window"], sliding, a["context_length"])} | {
        "rope_local_base": local_base
    }


def _gguf_scales(key, a: dict, big: int) -> dict:
    """llama.cpp's rule for the attention scale (the GGUF does not carry query_pre_attn_scalar): the 27B
    (`big` layers) scales by dim / heads, the others by head_dim."""
    scalar = a["dim"] / a["n_heads"] if a["n_layers"] == big else a["head_dim"]
    return {
        "embed_scale": a["dim"] ** 0.5,
        "attn_scale": float(scalar) ** -0.5,
        "attn_softcap": float(key("attn_logit_softcapping", 0.0) or 0.0),
        "final_softcap": float(key("final_logit_softcapping", 0.0) or 0.0),
    }


def _gemma2_gguf(key, a: dict) -> dict:
    sliding = gguf_pattern(key, a["n_layers"], 2)
    out = {**_gguf_scales(key, a, 46), **windowed(key("attention.sliding_window", 4096), sliding, a["context_length"])}
    base = key("rope.freq_base_swa", None)
    return out | ({"rope_local_base": float(base)} if base else {})


def _gemma3_gguf(key, a: dict) -> dict:
    window = key("attention.sliding_window", 0)
    sliding = gguf_pattern(key, a["n_layers"], 6) if window else ()
    local = {"rope_local_base": float(key("rope.freq_base_swa", 10000.0))} if window else {}
    return {**_gguf_scales(key, a, 62), **windowed(window, sliding, a["context_length"]), **local}


_GGUF_KEYS = frozenset(
    "attn_logit_softcapping final_logit_softcapping attention.sliding_window attention.sliding_window_pattern "
    "rope.freq_base_swa".split()
)

GEMMA2 = Family(
    "gemma2",
    hf_types=("gemma2",),
    gguf_archs=("gemma2",),
    block=_BLOCK,
    hf_defaults={
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "final_logit_softcapping": 30.0,
        "attn_logit_softcapping": 50.0,
        "hidden_activation": "gelu_pytorch_tanh",
        "head_dim": 256,
        "rope_theta": 10000.0,
    },
    hf_keys=_KEYS,
    hf_fields=_gemma2_hf,
    hf_names=_NAMES_HF,
    hf_norm_shift=1.0,
    gguf_keys=_GGUF_KEYS,
    gguf_fields=_gemma2_gguf,
)

GEMMA3 = Family(
    "gemma3",
    hf_types=("gemma3_text",),
    gguf_archs=("gemma3",),
    block={**_BLOCK, "qk_norm": "head"},
    hf_defaults={
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "hidden_activation": "gelu_pytorch_tanh",
        "head_dim": 256,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
    },
    hf_keys=_KEYS | {"rope_local_base_freq", "sliding_window_pattern", "_sliding_window_pattern"},
    hf_fields=_gemma3_hf,
    hf_names=_NAMES_HF,
    hf_norm_shift=1.0,
    gguf_keys=_GGUF_KEYS,
    gguf_fields=_gemma3_gguf,
)
