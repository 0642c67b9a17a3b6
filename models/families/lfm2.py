"""LFM2 (Liquid): a hybrid of short-convolution layers and attention layers (`layer_types` "conv" /
"full_attention", or transformers 4's `full_attn_idxs`). A convolution layer mixes tokens by a depthwise causal
convolution of `conv_L_cache` taps over B * x~ (models/shortconv.py); an attention layer has q/k norms per head
and its output projection named `out_proj`. Norms `operator_norm` (before the mixer) and `ffn_norm`; the final
norm is `embedding_norm`. The FFN's width is adjusted from `intermediate_size` (`block_auto_adjust_ff_dim`)."""

from __future__ import annotations

import dataclasses

from common.errors import CadenceError
from models.families.base import MOE_HF_KEYS, Family, Unsupported, hybrid_kinds

_KEYS = frozenset(
    "norm_eps conv_bias conv_L_cache block_multiple_of block_ffn_dim_multiplier block_auto_adjust_ff_dim "
    "full_attn_idxs block_dim block_ff_dim block_mlp_init_scale block_out_init_scale block_use_swiglu "
    "block_use_xavier_init block_norm_eps conv_dim conv_dim_out conv_use_xavier_init".split()
)


def _ffn_dim(cfg: dict) -> int:
    """transformers' Lfm2MLP width."""
    n = int(cfg["intermediate_size"])
    if not cfg.get("block_auto_adjust_ff_dim", True):
        return n
    n = int(2 * n / 3)
    if cfg.get("block_ffn_dim_multiplier") is not None:
        n = int(cfg["block_ffn_dim_multiplier"] * n)
        m = int(cfg.get("block_multiple_of", 256))
        n = m * ((n + m - 1) // m)
    return n


def _hf(cfg: dict, a: dict) -> dict:
    if cfg.get("conv_bias"):
        raise Unsupported("conv_bias: true (biases in the convolution layers)")
    n = a["n_layers"]
    full = cfg.get("full_attn_idxs")
    kind = lambda i: "full_attention" if full is None or i in full else "conv"  # noqa: E731 - transformers 4's
    types = hybrid_kinds(cfg, n, {"conv", "full_attention"}, kind)
    return {
        "conv_layers": tuple(i for i, t in enumerate(types) if t == "conv"),
        "conv_kernel": int(cfg.get("conv_L_cache") or 3),
        "ffn_dim": _ffn_dim(cfg),
        "norm_eps": float(cfg.get("norm_eps") or 1e-5),
    }


def _gguf(key, a: dict) -> dict:
    """llama.cpp's LFM2: the convolution layers are those with no kv heads; the FFN's width as the converter
    adjusted it."""
    kv = key("attention.head_count_kv")
    if not isinstance(kv, list) or len(kv) != a["n_layers"]:
        raise CadenceError("an LFM2 GGUF gives its kv heads a layer (0: a convolution layer); this one does not")
    return {"conv_layers": tuple(i for i, n in enumerate(kv) if not n), "conv_kernel": int(key("shortconv.l_cache"))}


LFM2 = Family(
    "lfm2",
    hf_types=("lfm2",),
    gguf_archs=("lfm2",),
    gguf_keys=frozenset({"vocab_size", "shortconv.l_cache"}),
    gguf_fields=_gguf,
    gguf_names={
        "out_norm": ("token_embd_norm",),
        "conv_in": ("shortconv.in_proj",),
        "conv_w": ("shortconv.conv",),
        "conv_out": ("shortconv.out_proj",),
    },
    block={"qk_norm": "head"},
    hf_defaults={"rope_theta": 1_000_000.0, "conv_L_cache": 3},
    hf_keys=_KEYS,
    hf_fields=_hf,
    hf_names={
        "attn_norm": ("operator_norm",),
        "attn_out": ("self_attn.out_proj",),
        "attn_q_norm": ("self_attn.q_layernorm",),
        "attn_k_norm": ("self_attn.k_layernorm",),
        "ffn_norm": ("ffn_norm",),
        "ffn_gate_up": ("feed_forward.w1", "feed_forward.w3"),
        "ffn_down": ("feed_forward.w2",),
        "conv_in": ("conv.in_proj",),
        "conv_w": ("conv.conv",),
        "conv_out": ("conv.out_proj",),
        "out_norm": ("embedding_norm",),
    },
)


def _moe(cfg: dict, a: dict) -> dict:
    return {
        **_hf({**cfg, "block_auto_adjust_ff_dim": False}, a),
        "dense_layers": tuple(range(int(cfg.get("num_dense_layers") or 0))),
        "router_sigmoid": True,
        "router_select_bias": bool(cfg.get("use_expert_bias", True)),
        "routed_scale": float(cfg.get("routed_scaling_factor") or 1.0),
        "norm_topk_eps": 1e-6,
    }


# LFM2-MoE: its first `num_dense_layers` FFNs dense, the rest experts chosen by sigmoid scores plus a bias that
# only chooses (`expert_bias`), renormalised and scaled
def _gguf_moe(key, a: dict) -> dict:
    """llama.cpp's lfm2moe: LFM2's layers; experts chosen by sigmoid scores plus the bias (`exp_probs_b`) after the
    leading dense layers, renormalised; scaled where `expert_weights_scale` says (its converter writes none)."""
    if int(key("expert_gating_func", SIGMOID)) != SIGMOID:
        raise Unsupported(f"expert_gating_func {key('expert_gating_func')} (LFM2-MoE's experts are chosen by sigmoid)")
    return {
        **_gguf(key, a),
        "dense_layers": tuple(range(int(key("leading_dense_block_count", 0)))),
        "router_sigmoid": True,
        "router_select_bias": True,
        "routed_scale": float(key("expert_weights_scale", 0.0)) or 1.0,
        "norm_topk": True,
        "norm_topk_eps": 1e-6,
    }


SIGMOID = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID

LFM2_MOE = dataclasses.replace(
    LFM2,
    name="lfm2_moe",
    hf_types=("lfm2_moe",),
    gguf_archs=("lfm2moe",),
    gguf_keys=LFM2.gguf_keys | {"expert_gating_func", "leading_dense_block_count", "expert_weights_scale"},
    gguf_fields=_gguf_moe,
    gguf_names={**LFM2.gguf_names, "ffn_router_sel": ("exp_probs_b.bias",)},
    gguf_params=frozenset({"ffn_router_sel"}),
    hf_keys=LFM2.hf_keys | MOE_HF_KEYS | {"num_dense_layers", "use_expert_bias", "routed_scaling_factor"},
    hf_fields=_moe,
    hf_names={**LFM2.hf_names, "ffn_router_sel": ("feed_forward.expert_bias",)},
    hf_params=frozenset({"ffn_router_sel"}),
    hf_moe_prefix="feed_forward",
)
