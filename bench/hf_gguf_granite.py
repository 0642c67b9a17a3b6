"""Granite 4.0-H (dense) as llama.cpp's converter writes it (`conversion/granite.py`: GraniteHybridModel over
Mamba2Model and GraniteMoeModel), for bench/hf_gguf.py: arch `granitehybrid`; the attention layers' q/k rows permuted
as LlamaModel's (undo_permute); the shared MLP's fused input split into `ffn_gate` and `ffn_up`; the Mamba layers'
convolution taps squeezed, A_log written as -exp(A_log) and D, both as [heads, 1], the gated norm as [groups, width],
dt_bias as `ssm_dt.bias`; the layer kinds as kv heads a layer (0: Mamba); no rope (`rope.scaling.finetuned` false)
and a context of 2^20."""

from __future__ import annotations

import torch

from bench.hf_gguf_qwen35 import TOP as _TOP

ARCHS = {"granitemoehybrid": "granitehybrid"}

_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "shared_mlp.output_linear": "ffn_down",
    "mamba.in_proj": "ssm_in",
    "mamba.conv1d": "ssm_conv1d",
    "mamba.norm": "ssm_norm",
    "mamba.out_proj": "ssm_out",
}
_PARAMS = {"mamba.dt_bias": "ssm_dt.bias", "mamba.A_log": "ssm_a", "mamba.D": "ssm_d"}  # no `.weight`


def attention_layers(h: dict) -> list[int]:
    """GraniteHybridModel.get_attn_layers, from either spelling of the layer kinds."""
    types = h.get("layer_types") or h.get("layers_block_type") or []
    return [i for i, t in enumerate(types) if t in ("attention", "full_attention")]


def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tensors(h: dict, named):
    """(GGUF name, tensor) for each of the model's (name, tensor) in the file's order."""
    inner, groups = h["mamba_expand"] * h["hidden_size"], h["mamba_n_groups"]
    for name, x in named:
        x = x.to(torch.float32) if x.dtype not in (torch.float16, torch.float32) else x
        module, _, suffix = name.rpartition(".")
        if module in _TOP:
            yield f"{_TOP[module]}.{suffix}", x
            continue
        if name in _TOP:
            yield _TOP[name], x
            continue
        _, _, bid, rest = name.split(".", 3)
        b = f"blk.{bid}"
        if rest == "shared_mlp.input_linear.weight":  # GraniteMoeModel: gate rows first
            gate, up = x.split(h["shared_intermediate_size"], dim=-2)
            yield f"{b}.ffn_gate.weight", gate
            yield f"{b}.ffn_up.weight", up
            continue
        if rest in _PARAMS:
            if rest == "mamba.A_log":
                x = -torch.exp(x)
            yield f"{b}.{_PARAMS[rest]}", x.reshape(*x.shape, 1) if rest != "mamba.dt_bias" else x
            continue
        module, _, suffix = rest.rpartition(".")
        if module == "self_attn.q_proj":
            x = _permute(x, h["num_attention_heads"])
        if module == "self_attn.k_proj":
            x = _permute(x, h["num_key_value_heads"])
        if module == "mamba.conv1d" and suffix == "weight":
            x = x.squeeze()
        if module == "mamba.norm":
            x = x.reshape(groups, inner // groups)
        yield f"{b}.{_LAYER[module]}.{suffix}", x


def multipliers(w, h: dict) -> None:
    """GraniteModel's: the multipliers under llama.cpp's *_scale names, each only where it is set (non-zero)."""
    for key, add in (
        ("attention_multiplier", w.add_attention_scale),
        ("embedding_multiplier", w.add_embedding_scale),
        ("residual_multiplier", w.add_residual_scale),
        ("logits_scaling", w.add_logit_scale),
    ):
        if h.get(key):
            add(h[key])


def params(w, h: dict, text_params) -> None:
    """GraniteHybridModel.set_gguf_parameters, after `text_params()` (TextModel's, LlamaModel's vocab size and rope
    dimensions): the multipliers, the shared FFN's width, the Mamba keys, kv heads a layer, no rope."""
    text_params({k: v for k, v in h.items() if k != "head_dim"})  # GraniteModel: "Ignoring head_dim"
    w.add_vocab_size(h["vocab_size"])
    w.add_rope_dimension_count(h["hidden_size"] // h["num_attention_heads"])
    multipliers(w, h)
    w.add_expert_shared_feed_forward_length(h["shared_intermediate_size"])
    w.add_ssm_conv_kernel(h["mamba_d_conv"])
    w.add_ssm_state_size(h["mamba_d_state"])
    w.add_ssm_group_count(h["mamba_n_groups"])
    w.add_ssm_inner_size(h["mamba_expand"] * h["hidden_size"])
    w.add_ssm_time_step_rank(h["mamba_n_heads"])
    attn = attention_layers(h)
    w.add_head_count_kv([h["num_key_value_heads"] if i in attn else 0 for i in range(h["num_hidden_layers"])])
    w.add_rope_scaling_finetuned(False)  # Granite 4.0-H: no rope (Bamba's would)
    w.add_context_length(2**20)
