"""OLMo 2 (norms after attention and after the FFN, on each branch's output before the residual add, none
before them; q/k norms over the whole projection) and OLMoE (a mixture of experts, q/k norms likewise)."""

from __future__ import annotations

from models.families.base import MOE_HF_KEYS, Family

_FULL_QK = {"attn_q_norm": ("self_attn.q_norm",), "attn_k_norm": ("self_attn.k_norm",)}

OLMO2 = Family(
    "olmo2",
    hf_types=("olmo2",),
    gguf_archs=("olmo2",),
    block={"pre_norm": False, "post_norm": True, "qk_norm": "full"},
    hf_defaults={"rms_norm_eps": 1e-5, "rope_theta": 10000.0},
    hf_names={
        **_FULL_QK,
        "attn_post_norm": ("post_attention_layernorm",),
        "ffn_post_norm": ("post_feedforward_layernorm",),
    },
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
