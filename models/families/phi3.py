"""Phi-3, Phi-3.5 and Phi-4-mini: Llama's block with q, k and v in one matrix and gate and up in one (gate
first), a partial rotary on Phi-4-mini, LongRoPE on the 128k variants, and a sliding window on every layer
where the config gives one (Phi-3-mini-4k: 2047)."""

from __future__ import annotations

from models.families.base import Family, windowed

PHI3 = Family(
    "phi3",
    hf_types=("phi3",),
    gguf_archs=("phi3",),
    hf_defaults={"rms_norm_eps": 1e-5, "sliding_window": None, "rope_theta": 10000.0},
    hf_keys=frozenset({"original_max_position_embeddings"}),
    hf_fields=lambda cfg, a: windowed(cfg["sliding_window"], tuple(range(a["n_layers"])), a["context_length"]),
    hf_names={"attn_qkv": ("self_attn.qkv_proj",), "ffn_gate_up": ("mlp.gate_up_proj",)},
    gguf_keys=frozenset({"attention.sliding_window"}),
    gguf_fields=lambda key, a: windowed(
        key("attention.sliding_window", 0), tuple(range(a["n_layers"])), a["context_length"]
    ),
    gguf_names={"attn_qkv": ("attn_qkv",), "ffn_gate_up": ("ffn_up",)},
)
