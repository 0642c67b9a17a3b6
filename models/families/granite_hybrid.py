"""Granite 4.0-H (`granitemoehybrid`, dense: H-Micro, H-1B, H-350M): Mamba-2 layers (models/recurrent.py) among
attention layers that take no rotary embeddings (`position_embedding_type` null), Granite's four multipliers, and a
shared SwiGLU MLP (`shared_mlp.input_linear`: gate rows first). transformers 4 spelled the layer kinds `mamba` and
`attention`. The mixture-of-experts variants (H-Tiny, H-Small) are refused naming their experts."""

from __future__ import annotations

from models.families.base import MAMBA_PARAMS, Family, Unsupported, check_mamba_steps, hybrid_kinds, mamba_names

_MULTIPLIERS = {
    "embedding_multiplier": "embed_scale",
    "attention_multiplier": "attn_scale",
    "residual_multiplier": "residual_scale",
    "logits_scaling": "logits_div",
}
_KEYS = frozenset(_MULTIPLIERS) | frozenset(
    "num_local_experts num_experts_per_tok output_router_logits router_aux_loss_coef shared_intermediate_size "
    "position_embedding_type layers_block_type mamba_n_heads mamba_n_groups mamba_d_state mamba_d_head mamba_d_conv "
    "mamba_expand mamba_chunk_size mamba_conv_bias mamba_proj_bias time_step_limit time_step_min time_step_max "
    "time_step_floor init_method".split()
)


def _hf(cfg: dict, a: dict) -> dict:
    if cfg.get("num_local_experts"):
        raise Unsupported(f"num_local_experts={cfg['num_local_experts']} (Granite 4.0-H's experts)")
    if cfg.get("mamba_proj_bias"):
        raise Unsupported("mamba_proj_bias: true (biases on the Mamba projections)")
    check_mamba_steps(cfg)
    n = a["n_layers"]
    cfg = {**cfg, "layer_types": cfg.get("layer_types") or cfg.get("layers_block_type")}
    types = hybrid_kinds(cfg, n, {"linear_attention", "full_attention"}, lambda i: "linear_attention")
    heads = int(cfg["mamba_n_heads"])
    inner = int(cfg.get("mamba_expand") or 2) * a["dim"]
    head_dim = cfg.get("mamba_d_head")
    attention = tuple(i for i, t in enumerate(types) if t == "full_attention")
    rope = cfg.get("position_embedding_type")
    if rope not in (None, "rope"):
        raise Unsupported(f"position_embedding_type={rope!r}")
    return {
        **{f: float(cfg[k]) for k, f in _MULTIPLIERS.items()},
        "ffn_dim": int(cfg["shared_intermediate_size"]),
        "ssm_layers": tuple(i for i, t in enumerate(types) if t == "linear_attention"),
        "ssm_heads": heads,
        "ssm_head_dim": inner // heads if head_dim in (None, "auto") else int(head_dim),
        "ssm_state": int(cfg["mamba_d_state"]),
        "ssm_groups": int(cfg.get("mamba_n_groups") or 1),
        "ssm_conv_bias": bool(cfg.get("mamba_conv_bias", True)),
        "conv_kernel": int(cfg.get("mamba_d_conv") or 4),
        "nope_layers": attention if rope is None else (),
    }


GRANITE_HYBRID = Family(
    "granitehybrid",
    hf_types=("granitemoehybrid",),
    gguf_archs=(),
    hf_defaults={**{k: 1.0 for k in _MULTIPLIERS}, "rope_theta": 10000.0, "mamba_expand": 2, "mamba_conv_bias": True},
    hf_keys=_KEYS,
    hf_fields=_hf,
    hf_names={
        "ffn_gate_up": ("shared_mlp.input_linear",),
        "ffn_down": ("shared_mlp.output_linear",),
        **mamba_names("mamba."),
    },
    hf_params=MAMBA_PARAMS,
)
