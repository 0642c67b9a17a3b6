"""GLM-4 (dense, GLM-4-0414): a norm before and after both the attention and the FFN (plain w), q/k/v biases,
gate and up in one matrix (gate first), and a partial rotary (half of each head) whose pairs are interleaved
(2i, 2i + 1) in both an HF directory and a GGUF (llama.cpp's NORM rope): the source moves them to the front halves
(formats/source.py `qkv_layout`)."""

from __future__ import annotations

from models.families.base import Family

GLM4 = Family(
    "glm4",
    hf_types=("glm4",),
    gguf_archs=("glm4",),
    block={"post_norm": True},
    hf_defaults={"rope_theta": 10000.0, "partial_rotary_factor": 0.5, "rms_norm_eps": 1.5625e-07},
    hf_names={
        "attn_post_norm": ("post_self_attn_layernorm",),
        "ffn_norm": ("post_attention_layernorm",),
        "ffn_post_norm": ("post_mlp_layernorm",),
        "ffn_gate_up": ("mlp.gate_up_proj",),
    },
    gguf_names={"ffn_gate_up": ("ffn_up",)},
    interleaved=True,
)
