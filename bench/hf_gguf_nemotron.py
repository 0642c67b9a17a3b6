"""Nemotron-H (dense) as llama.cpp's converter writes it (`conversion/nemotron.py`: NemotronHModel over
GraniteHybridModel, Mamba2Model and LlamaModel), for bench/hf_gguf.py: arch `nemotron_h`, tensor names from gguf-py's
map (every layer's `norm` its `attn_norm`, the MLP's `up_proj` / `down_proj` `ffn_up` / `ffn_down`); the attention
layers' q/k rows permuted as LlamaModel's (undo_permute, though llama.cpp runs them without rotary); the Mamba layers'
convolution taps squeezed, A_log written as -exp(A_log) and D, both as [heads, 1], the gated norm as [groups, width],
dt_bias as `ssm_dt.bias`. Keys: TextModel's without `head_dim` (GraniteModel drops it), the config's
`layer_norm_epsilon` beside the RMS one (here after the file type; the converter writes it just before), LlamaModel's
vocabulary size and rope dimensions, the Mamba sizes, the layer kinds as kv heads a layer (attention) and FFN widths a
layer (MLP), both 0 for a Mamba layer, no rope (`rope.scaling.finetuned` false, a context of 2^20), key and value
length from `head_dim`; after the vocabulary, `add_bos_token` true.

The converter reads config.json as the released checkpoints spell it: the layer kinds a `hybrid_override_pattern`
string (M, *, -) and no expert keys (a `num_experts_per_tok` makes it write `nemotron_h_moe`). transformers 5 saves
the kinds as `layers_block_type` names the converter does not know and MoE defaults in every config, so the pattern
is rebuilt from the kinds here and the expert keys are not written, as for the released files."""

from __future__ import annotations

import torch

ARCHS = {"nemotron_h": "nemotron_h"}
_KIND = {"mamba": "M", "linear_attention": "M", "attention": "*", "full_attention": "*", "mlp": "-", "moe": "E"}


def pattern(h: dict) -> str:
    """The layer kinds as the released configs' `hybrid_override_pattern`, from either spelling; experts refused."""
    kinds = h.get("hybrid_override_pattern")
    kinds = kinds if isinstance(kinds, str) else "".join(_KIND[t] for t in h["layers_block_type"])
    if "E" in kinds:
        raise NotImplementedError("Nemotron-3's experts (llama.cpp's nemotron_h_moe) are not reproduced here")
    return kinds


def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tensors(h: dict, named):
    """(GGUF name, tensor) for each of the model's (name, tensor) in the file's order: Mamba2Model's changes in the
    Mamba layers, LlamaModel's in the attention ones, ModelBase's renaming alone in the MLPs and outside the layers."""
    import gguf

    kinds = pattern(h)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.NEMOTRON_H, len(kinds))
    groups, inner = h["n_groups"], h["mamba_num_heads"] * h["mamba_head_dim"]
    for name, x in named:
        x = x.to(torch.float32) if x.dtype not in (torch.float16, torch.float32) else x
        if name.endswith(".dt_bias"):  # Mamba2Model.filter_tensors
            name = name.removesuffix("dt_bias") + "dt_proj.bias"
        parts = name.split(".")
        kind = kinds[int(parts[2])] if parts[1] == "layers" else ""
        if kind == "M" and name.endswith("mixer.conv1d.weight"):
            x = x.squeeze()
        elif kind == "M" and name.endswith(("mixer.A_log", "mixer.D")):
            x = x.reshape(*x.shape, 1)
        elif kind == "M" and name.endswith("mixer.norm.weight"):
            x = x.reshape(groups, inner // groups)
        if kind == "M" and name.endswith(".A_log"):
            x = -torch.exp(x)
        if kind == "*" and name.endswith(("q_proj.weight", "q_proj.bias")):
            x = _permute(x, h["num_attention_heads"])
        if kind == "*" and name.endswith(("k_proj.weight", "k_proj.bias")):
            x = _permute(x, h["num_key_value_heads"])
        yield names.get_name(name, try_suffixes=(".weight", ".bias")), x


def params(w, h: dict, text_params) -> None:
    """NemotronHModel.set_gguf_parameters: GraniteHybridModel's (TextModel's, LlamaModel's, the Mamba sizes, kv heads
    a layer, no rope), then key and value length and FFN widths a layer."""
    kinds = pattern(h)
    n = len(kinds)
    text_params({k: v for k, v in h.items() if k != "head_dim"} | {"num_hidden_layers": n})
    if h.get("layer_norm_epsilon") is not None:  # TextModel: the layer norm's epsilon, whatever norms a model has
        w.add_layer_norm_eps(h["layer_norm_epsilon"])
    w.add_vocab_size(h["vocab_size"])
    w.add_rope_dimension_count(h["hidden_size"] // h["num_attention_heads"])
    w.add_ssm_conv_kernel(h["conv_kernel"])
    w.add_ssm_state_size(h["ssm_state_size"])
    w.add_ssm_group_count(h["n_groups"])
    w.add_ssm_inner_size(h["mamba_num_heads"] * h["mamba_head_dim"])
    w.add_ssm_time_step_rank(h["mamba_num_heads"])
    w.add_head_count_kv([h["num_key_value_heads"] if k == "*" else 0 for k in kinds])
    use_rope = "M" not in kinds  # GraniteHybridModel: rope for Bamba or a model without Mamba layers only
    w.add_rope_scaling_finetuned(use_rope)
    if not use_rope:
        w.add_context_length(2**20)
    w.add_key_length(h["head_dim"])
    w.add_value_length(h["head_dim"])
    w.add_feed_forward_length([h["intermediate_size"] if k == "-" else 0 for k in kinds])


def after_vocab(w, h: dict) -> None:
    """NemotronHModel.set_vocab: its tokenizer adds a BOS by its template, which the converter writes as a key."""
    w.add_add_bos_token(True)
