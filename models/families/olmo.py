"""OLMo 2 (norms after attention and after the FFN, on each branch's output before the residual add, none
before them; q/k norms over the whole projection), OLMo 3 (the same block, three sliding-window layers in four,
whose rotary stays unscaled where the full layers' is scaled) and OLMoE (a mixture of experts, q/k norms
likewise). llama.cpp writes OLMo 3 as `olmo2` with a window."""

from __future__ import annotations

from models.families.base import MOE_HF_KEYS, SLIDING, Family, Unsupported, gguf_pattern, hf_rope, layer_kinds, windowed

_FULL_QK = {"attn_q_norm": ("self_attn.q_norm",), "attn_k_norm": ("self_attn.k_norm",)}

_OLMO2_NAMES = {
    **_FULL_QK,
    "attn_post_norm": ("post_attention_layernorm",),
    "ffn_post_norm": ("post_feedforward_layernorm",),
}


def _olmo3_hf(cfg: dict, a: dict) -> dict:
    sliding = layer_kinds(cfg, a["n_layers"], lambda i: (i + 1) % 4 != 0)
    local_base, local_scaling, _ = hf_rope(cfg, a["head_dim"], SLIDING)
    if local_scaling is not None:
        raise Unsupported(f"rope scaling '{local_scaling.kind}' on the sliding layers (cadence scales full ones)")
    return {**windowed(cfg["sliding_window"], sliding, a["context_length"]), "rope_local_base": local_base}


def _olmo2_gguf(key, a: dict) -> dict:
    """llama.cpp's olmo2 with a window (OLMo 3): the converter's per-layer flags (llama.cpp itself reads one full layer
    in four), the sliding layers' rope unscaled."""
    window = key("attention.sliding_window", 0)
    if not window:
        return {}
    sliding = gguf_pattern(key, a["n_layers"], 4)
    local_base = float(key("rope.freq_base_swa", a["rope_base"]))
    return {**windowed(window, sliding, a["context_length"]), "rope_local_base": local_base}


OLMO2 = Family(
    "olmo2",
    hf_types=("olmo2",),
    gguf_archs=("olmo2",),
    block={"pre_norm": False, "post_norm": True, "qk_norm": "full"},
    hf_defaults={"rms_norm_eps": 1e-5, "rope_theta": 10000.0},
    hf_names=_OLMO2_NAMES,
)

OLMO3 = Family(
    "olmo3",
    hf_types=("olmo3",),
    gguf_archs=(),  # llama.cpp writes OLMo 3 as `olmo2` with a window (models/source.py tells them apart)
    block={"pre_norm": False, "post_norm": True, "qk_norm": "full"},
    hf_defaults={"rms_norm_eps": 1e-5, "rope_theta": 10000.0, "sliding_window": 4096},
    hf_fields=_olmo3_hf,
    hf_names=_OLMO2_NAMES,
    gguf_keys=frozenset({"attention.sliding_window", "attention.sliding_window_pattern", "rope.freq_base_swa"}),
    gguf_fields=_olmo2_gguf,
)

OLMOE = Family(
    "olmoe",
    hf_types=("olmoe",),
    gguf_archs=("olmoe",),
    block={"qk_norm": "full"},
    hf_defaults={"rms_norm_eps": 1e-5, "rope_theta": 10000.0},
    hf_keys=MOE_HF_KEYS | {"clip_qkv"},
    hf_names=_FULL_QK,
)
