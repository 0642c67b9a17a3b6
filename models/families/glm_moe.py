"""GLM-4.5 (`glm4_moe`: GLM-4.5, GLM-4.5-Air, GLM-4.6): a DeepSeek-V3-like layer without MLA: GQA with q/k/v
biases, q/k norms per head where `use_qk_norm`, a partial rotary (half a head, NeoX order, unlike GLM-4's
interleaved pairs); its first `first_k_dense_replace` FFNs dense, the rest experts chosen by sigmoid scores plus a
bias that only chooses (`e_score_correction_bias`), renormalised and scaled, beside ungated shared experts. Its
multi-token prediction layer (`model.layers.<n_layers>`) is left aside."""

from __future__ import annotations

from models.families.base import MOE_HF_KEYS, Family, Unsupported

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


GLM4_MOE = Family(
    "glm4_moe",
    hf_types=("glm4_moe",),
    gguf_archs=(),
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
