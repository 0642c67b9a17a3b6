"""gpt-oss (OpenAI): attention with q/k/v and output biases and a learned sink logit per head in every softmax
(models/attention.py `attend`), sliding-window layers (128) alternating with full ones, YaRN without truncation;
a mixture of experts whose router (with a bias) softmaxes its top k logits, and whose experts have biases and a
clamped SwiGLU, (up + 1) * gate * sigmoid(1.702 gate). The released checkpoints keep the experts in MXFP4 blocks
(dequantized as read: models/source_hf.py `mxfp4`), fused [experts, in, out] with gate and up interleaved."""

from __future__ import annotations

from models.families.base import MOE_HF_KEYS, Family, Unsupported, layer_kinds, windowed


def _hf(cfg: dict, a: dict) -> dict:
    if cfg.get("hidden_act", "silu") != "silu":
        raise Unsupported(f"hidden_act {cfg['hidden_act']!r}")
    sliding = layer_kinds(cfg, a["n_layers"], lambda i: i % 2 == 0)
    return {
        **windowed(cfg.get("sliding_window"), sliding, a["context_length"]),
        "norm_topk": False,
        "swiglu_limit": float(cfg.get("swiglu_limit") or 7.0),
        "swiglu_alpha": float(cfg.get("swiglu_alpha") or 1.702),
    }


GPT_OSS = Family(
    "gpt_oss",
    hf_types=("gpt_oss",),
    gguf_archs=(),
    block={
        "attn_sinks": True,
        "attn_out_bias": True,
        "router_bias": True,
        "router_topk_first": True,
        "expert_bias": True,
    },
    hf_defaults={"rope_theta": 150000.0, "rms_norm_eps": 1e-5, "sliding_window": 128},
    hf_keys=MOE_HF_KEYS | frozenset({"swiglu_alpha", "swiglu_limit"}),
    hf_fields=_hf,
    hf_names={
        "ffn_router": ("mlp.router",),
        "attn_sinks": ("self_attn.sinks",),
        "attn_out_bias": ("self_attn.o_proj.bias",),
        "ffn_router_bias": ("mlp.router.bias",),
    },
    hf_params=frozenset({"attn_sinks", "attn_out_bias", "ffn_router_bias"}),
    experts_xw="interleaved",
)
