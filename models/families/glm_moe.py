"""GLM-4.5 (`glm4_moe`: GLM-4.5, GLM-4.5-Air, GLM-4.6): a DeepSeek-V3-like layer without MLA: GQA with q/k/v
biases, q/k norms per head where `use_qk_norm`, a partial rotary (half a head, NeoX order, unlike GLM-4's
interleaved pairs); its first `first_k_dense_replace` FFNs dense, the rest experts chosen by sigmoid scores plus a
bias that only chooses (`e_score_correction_bias`), renormalised and scaled, beside ungated shared experts. Its
multi-token prediction layer (`model.layers.<n_layers>`) is left aside.

llama.cpp's `glm4moe` GGUF (its converter's Glm4MoeModel) counts that layer among its blocks (`block_count` is
the layers plus `nextn_predict_layers`, whose tensors the reader leaves aside too); it names the pre-FFN norm
`post_attention_norm` and the choosing bias `exp_probs_b.bias`, and says the rest in keys: the leading dense
layers, the sigmoid gating, `expert_weights_scale` and `expert_weights_norm`. Its q/k norms are there where the
model has them (GLM-4.5-Air has none), as llama.cpp finds them."""

from __future__ import annotations

from common.errors import CadenceError
from models.families.base import MOE_HF_KEYS, Family, Unsupported
from models.families.lfm2 import SIGMOID

_KEYS = MOE_HF_KEYS | frozenset(
    "n_shared_experts n_routed_experts routed_scaling_factor n_group topk_group first_k_dense_replace use_qk_norm "
    "num_mtp_layers num_nextn_predict_layers".split()
)


def _hf(cfg: dict, a: dict) -> dict:
    if int(cfg.get("n_group") or 1) != 1 or int(cfg.get("topk_group") or 1) != 1:
        raise Unsupported(f"n_group={cfg.get('n_group')}, topk_group={cfg.get('topk_group')} (group-limited routing)")
    return {
        "qk_norm": "head" if cfg.get("use_qk_norm") else "",
        "dense_layers": tuple(range(int(cfg.get("first_k_dense_replace") or 0))),
        "router_sigmoid": True,
        "router_select_bias": True,
        "routed_scale": float(cfg.get("routed_scaling_factor") or 1.0),
        "norm_topk": bool(cfg.get("norm_topk_prob", True)),
        "norm_topk_eps": 1e-20,
        "shared_ffn_dim": int(cfg["moe_intermediate_size"]) * int(cfg.get("n_shared_experts") or 0),
        "shared_gated": False,
    }


def _gguf(key, a: dict) -> dict:
    """llama.cpp's glm4moe: the blocks less the prediction layers; experts after the leading dense layers, chosen by
    sigmoid scores plus the bias in no groups, renormalised where `expert_weights_norm`, scaled where
    `expert_weights_scale` (0: not)."""
    if int(key("expert_gating_func", SIGMOID) or SIGMOID) != SIGMOID:  # llama.cpp: none (0) is sigmoid
        raise CadenceError(
            f"a glm4moe GGUF with expert_gating_func {key('expert_gating_func')} is not run (sigmoid is)"
        )
    if int(key("expert_group_count", 1) or 1) != 1:
        raise CadenceError(f"expert_group_count {key('expert_group_count')} (group-limited routing) is not run yet")
    return {
        "n_layers": a["n_layers"] - int(key("nextn_predict_layers", 0)),
        "dense_layers": tuple(range(int(key("leading_dense_block_count", 0)))),
        "router_sigmoid": True,
        "router_select_bias": True,
        "routed_scale": float(key("expert_weights_scale", 0.0)) or 1.0,
        "norm_topk_eps": 1e-20,
        "shared_gated": False,
    }


GLM4_MOE = Family(
    "glm4_moe",
    hf_types=("glm4_moe",),
    gguf_archs=("glm4moe",),
    gguf_keys=frozenset(
        "expert_gating_func expert_group_count expert_group_used_count expert_shared_count leading_dense_block_count "
        "expert_weights_scale nextn_predict_layers".split()
    ),
    gguf_fields=_gguf,
    gguf_names={"ffn_norm": ("post_attention_norm",), "ffn_router_sel": ("exp_probs_b.bias",)},
    gguf_params=frozenset({"ffn_router_sel"}),
    gguf_tensor_fields=lambda tensors: {"qk_norm": "head" if "blk.0.attn_q_norm.weight" in tensors else ""},
    hf_defaults={"rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    hf_keys=_KEYS,
    hf_fields=_hf,
    hf_names={
        "ffn_router_sel": ("mlp.gate.e_score_correction_bias",),
        "ffn_shexp_gate_up": ("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj"),
        "ffn_shexp_down": ("mlp.shared_experts.down_proj",),
    },
    hf_params=frozenset({"ffn_router_sel"}),
)
