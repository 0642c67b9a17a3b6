"""The presets of bench/synth_family.py for the families of 2026 that llama.cpp runs: their config arguments beyond
the common trunk (hidden 1024, 16 layers, 16 heads / 4 kv heads of 64, FFN 3072, Qwen 2.5's tokenizer).

Each keeps the trunk where the family allows it and takes its own shape where the family has one, as the released
small checkpoints do: Qwen 3.5 its attention (8 / 2 heads of 256, a quarter rotated) and delta-nets (16 heads of
128) one layer in four; Gemma 4 Gemma's 8 / 4 heads of 128 on its sliding layers and 2 heads of 256 (values = keys)
on one layer in six, the last among them; the Mamba-2 families a mixer twice the hidden size (heads of 64, a state
of 128); Nemotron-H its 32 one-part layers (16 mixers, 2 of them attention, each followed by an MLP); Granite 4.0-H
and Nemotron-H 2 attention layers of 16; LFM2 350M's 6 attention layers among convolutions. The mixtures of
experts keep about the trunk's FFN active: gpt-oss 16 experts of 768, 4 a token; GLM-4.5-Air a dense first layer,
then 16 experts of 768, 3 a token, and a shared one; Llama 4 Scout 8 experts of 1536, 1 a token, and a shared one
(~1 B parameters each, ~0.6 GB at Q4_K_M). Only what llama.cpp runs as transformers does is used here
(bench/llama_cpp_families.py): Granite 4.0-H's mamba_expand 2, EXAONE 4 without a window (the 1.2B: llama.cpp
windows only a 64-layer one), Gemma 4's logits capped at 30 (llama.cpp caps them at 30 where a GGUF has no cap),
Falcon-H1 without the Mamba-2 norm before the gate.
"""

from __future__ import annotations

_MAMBA = dict(mamba_n_heads=32, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=128, mamba_d_conv=4)
_MOE_ATTN = dict(num_attention_heads=16, num_key_value_heads=4, head_dim=64)
_TWO_OF_16 = (5, 13)  # the attention layers of the 16-mixer hybrids


def _nemotron_kinds() -> list[str]:
    """16 mixers (Mamba-2, attention at _TWO_OF_16), each followed by a relu^2 MLP: 32 layers of one part."""
    return [k for i in range(16) for k in ("full_attention" if i in _TWO_OF_16 else "linear_attention", "mlp")]


PRESETS_2026: dict[str, tuple[str, dict]] = {
    "qwen35": (
        "qwen3_5_text",
        dict(
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=256,
            linear_num_key_heads=16,
            linear_num_value_heads=16,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_conv_kernel_dim=4,
            rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
        ),
    ),
    "lfm2": (
        "lfm2",
        dict(
            layer_types=["full_attention" if i in (2, 5, 8, 10, 12, 14) else "conv" for i in range(16)],
            block_auto_adjust_ff_dim=False,
            norm_eps=1e-5,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        ),
    ),
    "granitehybrid": (
        "granitemoehybrid",
        dict(
            _MAMBA,
            layer_types=["full_attention" if i in _TWO_OF_16 else "linear_attention" for i in range(16)],
            num_local_experts=0,
            shared_intermediate_size=3072,
            mamba_expand=2,
            embedding_multiplier=12.0,
            attention_multiplier=0.0078125,
            residual_multiplier=0.22,
            logits_scaling=8.0,
            tie_word_embeddings=True,
        ),
    ),
    "nemotron_h": (
        "nemotron_h",
        dict(
            num_hidden_layers=32,
            layers_block_type=_nemotron_kinds(),
            mamba_num_heads=32,
            mamba_head_dim=64,
            n_groups=8,
            ssm_state_size=128,
            conv_kernel=4,
            layer_norm_epsilon=1e-5,
        ),
    ),
    "falcon-h1": (
        "falcon_h1",
        dict(
            _MAMBA,
            mamba_d_ssm=2048,
            mamba_rms_norm=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1e11},
        ),
    ),
    "gemma4": (
        "gemma4_text",
        dict(
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=128,
            global_head_dim=256,
            num_global_key_value_heads=2,
            attention_k_eq_v=True,
            sliding_window=512,
            layer_types=["full_attention" if i % 6 == 3 else "sliding_attention" for i in range(16)],  # the last full
            hidden_size_per_layer_input=0,
            final_logit_softcapping=30.0,
            tie_word_embeddings=True,
        ),
    ),
    "gpt-oss": (
        "gpt_oss",
        dict(
            _MOE_ATTN,
            num_local_experts=16,
            num_experts_per_tok=4,
            intermediate_size=768,
            sliding_window=128,
            max_position_embeddings=131072,
        ),
    ),
    "llama4": (
        "llama4_text",
        dict(
            _MOE_ATTN,
            num_local_experts=8,
            num_experts_per_tok=1,
            intermediate_size=1536,
            intermediate_size_mlp=3072,
            interleave_moe_layer_step=1,
            use_qk_norm=True,
            attention_chunk_size=8192,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 16.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 1.0,
                "original_max_position_embeddings": 8192,
            },
        ),
    ),
    "glm4moe": (
        "glm4_moe",
        dict(
            _MOE_ATTN,
            attention_bias=True,
            use_qk_norm=False,
            first_k_dense_replace=1,
            n_routed_experts=16,
            num_experts_per_tok=3,
            moe_intermediate_size=768,
            n_shared_experts=1,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5},
        ),
    ),
    "smollm3": ("smollm3", dict(rope_parameters={"rope_type": "default", "rope_theta": 2e6})),  # NoPE every 4th
    "olmo3": ("olmo3", dict(sliding_window=4096, rope_parameters={"rope_type": "default", "rope_theta": 500000.0})),
    "exaone4": (
        "exaone4",
        dict(
            sliding_window=None,
            layer_types=["full_attention"] * 16,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        ),
    ),
    "ministral3": (
        "ministral3",
        dict(
            max_position_embeddings=262144,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 1e6,
                "factor": 16.0,
                "original_max_position_embeddings": 16384,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "llama_4_scaling_beta": 0.1,
            },
        ),
    ),
    "seed_oss": ("seed_oss", dict(attention_bias=True, rope_parameters={"rope_type": "default", "rope_theta": 1e7})),
    "glm4": (
        "glm4",
        dict(
            attention_bias=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
        ),
    ),
}
