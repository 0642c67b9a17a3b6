"""Falcon-H1 as llama.cpp's converter writes it (`conversion/falcon_h1.py`: FalconH1Model over Mamba2Model), for
bench/hf_gguf.py: arch `falcon-h1`, tensor names from gguf-py's map (the pre-FFN norm `blk.N.ffn_norm`, with no
`.weight`); Mamba2Model's changes in every layer (the convolution taps squeezed, A_log written as -exp(A_log) and D,
both as [heads, 1], the gated norm as [groups, width], dt_bias as `ssm_dt.bias`); no q/k permutation (llama.cpp's
NEOX rope). Every muP multiplier is folded into the tensor it follows, in float32 as the converter multiplies: the
MLP's gate and down, q, k (key_multiplier, then attention_in_multiplier), v, o, the Mamba out projection, the in
projection (ssm_in_multiplier, then each of z, x, B, C, dt's rows), the head and the embeddings; none is a key.

Keys: FalconH1Model writes Mamba2Model's (a context of 2^20, no FFN, no heads, the Mamba sizes, the RMS epsilon, the
file type) and then its own over them (the context, FFN width and heads again, vocabulary size, key and value length,
rope base). Those are TextModel's keys for a model with no rope scaling and the same values, which is how they are
written here, with the Mamba sizes after them (the converter's order differs; no reader depends on it). The released
configs spell `head_dim`; a config transformers 5 saves for a small model may not, and it is hidden / heads then."""

from __future__ import annotations

import torch

ARCHS = {"falcon_h1": "falcon-h1"}


def _mamba2(name: str, x: torch.Tensor, groups: int, inner: int) -> torch.Tensor:
    """Mamba2Model.modify_tensors."""
    if name.endswith("mamba.conv1d.weight"):
        x = x.squeeze()
    elif name.endswith(("mamba.A_log", "mamba.D")):
        x = x.reshape(*x.shape, 1)
    elif name.endswith("mamba.norm.weight"):
        x = x.reshape(groups, inner // groups)
    return -torch.exp(x) if name.endswith(".A_log") else x


def _multiplied(name: str, x: torch.Tensor, h: dict) -> torch.Tensor:
    """FalconH1Model.modify_tensors: the multipliers, tested on the HF name in its order."""
    gate, down = h["mlp_multipliers"]
    if "down_proj" in name:
        return x * down
    if "gate_proj" in name:
        return x * gate
    if "k_proj" in name:
        return x * h["key_multiplier"] * h["attention_in_multiplier"]
    if "q_proj" in name or "v_proj" in name:
        return x * h["attention_in_multiplier"]
    if "o_proj" in name:
        return x * h["attention_out_multiplier"]
    if "out_proj" in name:
        return x * h["ssm_out_multiplier"]
    if "in_proj" in name:
        x = x * h["ssm_in_multiplier"]
        inner, gn = h["mamba_d_ssm"], h["mamba_n_groups"] * h["mamba_d_state"]
        z, xs, b, c, dt = h["ssm_multipliers"]
        x[:inner, :] *= z
        x[inner : 2 * inner, :] *= xs
        x[2 * inner : 2 * inner + gn, :] *= b
        x[2 * inner + gn : 2 * inner + 2 * gn, :] *= c
        x[2 * inner + 2 * gn :, :] *= dt
        return x
    if "lm_head" in name:
        return x * h["lm_head_multiplier"]
    if "embed_tokens" in name:
        return x * h["embedding_multiplier"]
    return x


def tensors(h: dict, named):
    """(GGUF name, tensor) for each of the model's (name, tensor) in the file's order."""
    import gguf

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.FALCON_H1, h["num_hidden_layers"])
    for name, x in named:
        x = x.to(torch.float32) if x.dtype not in (torch.float16, torch.float32) else x
        if name.endswith(".dt_bias"):  # Mamba2Model.filter_tensors
            name = name.removesuffix("dt_bias") + "dt_proj.bias"
        x = _mamba2(name, x, h["mamba_n_groups"], h["mamba_d_ssm"])
        yield names.get_name(name, try_suffixes=(".weight", ".bias")), _multiplied(name, x, h)


def params(w, h: dict, text_params) -> None:
    """FalconH1Model.set_gguf_parameters (see the module's note on the keys' order)."""
    rope = h.get("rope_parameters") or h.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise NotImplementedError("FalconH1Model writes no rope scaling; a scaled Falcon-H1 is not reproduced here")
    eps = h.get("layer_norm_epsilon") or h["rms_norm_eps"]  # Mamba2Model: layer_norm_epsilon first
    text_params({k: v for k, v in h.items() if k != "head_dim"} | {"rms_norm_eps": eps})
    w.add_ssm_conv_kernel(h["mamba_d_conv"])
    w.add_ssm_inner_size(h["mamba_d_ssm"])
    w.add_ssm_state_size(h["mamba_d_state"])
    w.add_ssm_time_step_rank(h["mamba_d_ssm"] // h["mamba_d_head"])
    w.add_ssm_group_count(h["mamba_n_groups"])
    w.add_vocab_size(h["vocab_size"])
    head_dim = h.get("head_dim") or h["hidden_size"] // h["num_attention_heads"]
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
