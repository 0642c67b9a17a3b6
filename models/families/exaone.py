"""EXAONE 4: OLMo 2's norms (after each branch's output, none before), q/k norms per head before RoPE, and
sliding-window layers among global ones ("LLLG"): the sliding layers rotate, the global ones take no rotary
embeddings (NoPE). Without a window (the 1.2B) every layer is global and rotates."""

from __future__ import annotations

from models.families.base import Family, gguf_pattern, layer_kinds, windowed

_NAMES = {"attn_post_norm": ("post_attention_layernorm",), "ffn_post_norm": ("post_feedforward_layernorm",)}


def _pattern(cfg: dict, i: int) -> bool:
    """transformers' default layer kinds: `sliding_window_pattern` an int (one global layer in n) or a string of
    L (local, sliding) and G (global), repeated."""
    p = cfg.get("sliding_window_pattern")
    if isinstance(p, str):
        return p[i % len(p)] == "L"
    return bool(p) and (i + 1) % int(p) != 0


def _hf(cfg: dict, a: dict) -> dict:
    if cfg.get("sliding_window") is None:
        return {}
    sliding = layer_kinds(cfg, a["n_layers"], lambda i: _pattern(cfg, i))
    nope = tuple(i for i in range(a["n_layers"]) if i not in sliding)
    return {"nope_layers": nope, **windowed(cfg["sliding_window"], sliding, a["context_length"])}


def _gguf(key, a: dict) -> dict:
    window = key("attention.sliding_window", 0)
    if not window:
        return {}
    sliding = gguf_pattern(key, a["n_layers"], 4)  # the converter's flags (llama.cpp reads them for the 32B only)
    nope = tuple(i for i in range(a["n_layers"]) if i not in sliding)
    return {"nope_layers": nope, **windowed(window, sliding, a["context_length"])}


EXAONE4 = Family(
    "exaone4",
    hf_types=("exaone4",),
    gguf_archs=("exaone4",),
    block={"pre_norm": False, "post_norm": True, "qk_norm": "head"},
    hf_defaults={"rms_norm_eps": 1e-5, "rope_theta": 10000.0, "sliding_window": 4096, "sliding_window_pattern": 4},
    hf_keys=frozenset({"sliding_window_pattern"}),
    hf_fields=_hf,
    hf_names=_NAMES,
    gguf_names={"attn_post_norm": ("post_attention_norm",), "ffn_post_norm": ("post_ffw_norm",)},
    gguf_keys=frozenset({"attention.sliding_window", "attention.sliding_window_pattern"}),
    gguf_fields=_gguf,
)
