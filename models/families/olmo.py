"""OLMo 2 (norms after attention and after the FFN, on each branch's output before the residual add, none
before them; q/k norms over the whole projection), OLMo 3 (the same block, three sliding-window layers in four,
whose rotary stays unscaled where the full layers' is scaled) and OLMoE (a mixture of experts, q/k norms
likewise). llama.cpp writes OLMo 3 as `olmo2` with a window. OLMo-hybrid: OLMo 3's post-norm attention layers (no
rotary unless the config gives a base) among gated delta-net layers with norms before their branches (models/
recurrent.py: separate q/k/v/a/b/g projections, beta up to 2 where `linear_allow_neg_eigval`)."""

from __future__ import annotations

from models.families.base import (
    MOE_HF_KEYS,
    SLIDING,
    Family,
    Unsupported,
    gguf_pattern,
    hf_rope,
    hybrid_kinds,
    layer_kinds,
    windowed,
)

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
    gguf_archs=(),  # llama.cpp writes OLMo 3 as `olmo2` with a window (formats/source.py tells them apart)
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


_HYBRID_KEYS = frozenset(
    "linear_num_key_heads linear_num_value_heads linear_key_head_dim linear_value_head_dim linear_a_log_min "
    "linear_a_log_max linear_dt_min linear_dt_max linear_dt_init_floor linear_conv_kernel_dim "
    "linear_allow_neg_eigval".split()
)


def _hybrid_hf(cfg: dict, a: dict) -> dict:
    n = a["n_layers"]
    kind = lambda i: "full_attention" if i % 4 == 3 else "linear_attention"  # noqa: E731
    types = hybrid_kinds(cfg, n, {"linear_attention", "full_attention"}, kind)
    gdn = tuple(i for i, t in enumerate(types) if t == "linear_attention")
    rope = cfg.get("rope_parameters") or {}
    nope = () if (rope.get("rope_theta") or cfg.get("rope_theta")) else tuple(i for i in range(n) if i not in gdn)
    hk = int(cfg.get("linear_num_key_heads") or a["n_heads"])
    dk = int(cfg.get("linear_key_head_dim") or 0.75 * a["dim"] / hk)
    return {
        "gdn_layers": gdn,
        "pre_only_layers": gdn,
        "gdn_k_heads": hk,
        "gdn_v_heads": int(cfg.get("linear_num_value_heads") or hk),
        "gdn_k_dim": dk,
        "gdn_v_dim": int(cfg.get("linear_value_head_dim") or 2 * dk),
        "conv_kernel": int(cfg.get("linear_conv_kernel_dim") or 4),
        "gdn_beta_scale": 2.0 if cfg.get("linear_allow_neg_eigval", True) else 1.0,
        "gdn_norm_eps": 1e-5,
        "nope_layers": nope,
    }


OLMO_HYBRID = Family(
    "olmo_hybrid",
    hf_types=("olmo_hybrid",),
    gguf_archs=(),
    block={"pre_norm": False, "post_norm": True, "qk_norm": "full"},
    hf_defaults={"rms_norm_eps": 1e-6},
    hf_keys=_HYBRID_KEYS,
    hf_fields=_hybrid_hf,
    # OLMo-core's names, as the checkpoints and transformers' save keep them: a delta-net layer's norms before its
    # branches, and the attention layers' post-attention norm, are `attention_layer_norm` / `feedforward_layer_norm`;
    # the convolution's taps are split in three (concatenated, q k v's channels in order)
    hf_names={
        **_FULL_QK,
        "attn_norm": ("attention_layer_norm",),
        "ffn_norm": ("feedforward_layer_norm",),
        "attn_post_norm": ("feedforward_layer_norm",),
        "ffn_post_norm": ("post_feedforward_layernorm",),
        "gdn_in": (
            "linear_attn.q_proj",
            "linear_attn.k_proj",
            "linear_attn.v_proj",
            "linear_attn.g_proj",
            "linear_attn.b_proj",
            "linear_attn.a_proj",
        ),
        "gdn_conv": ("linear_attn.q_conv1d", "linear_attn.k_conv1d", "linear_attn.v_conv1d"),
        "gdn_dt": ("linear_attn.dt_bias",),
        "gdn_a": ("linear_attn.A_log",),
        "gdn_norm": ("linear_attn.o_norm",),
        "gdn_out": ("linear_attn.o_proj",),
    },
    hf_params=frozenset({"gdn_dt", "gdn_a"}),
)
