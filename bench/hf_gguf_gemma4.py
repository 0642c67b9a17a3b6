"""Gemma 4 (text) as llama.cpp's converter writes it (`conversion/gemma.py`: Gemma4Model over Gemma3Model), for
bench/hf_gguf.py: arch `gemma4`. Keys: TextModel's, then Gemma 3's (the final soft-cap, the window), then Gemma 4's:
`attention.shared_kv_layers`, `embedding_length_per_layer_input` (0 without per-layer embeddings), the sliding layers
as a list of flags, `attention.key_length`/`value_length` the full layers' head size and `*_swa` the sliding ones',
the experts' width, `feed_forward_length` one a layer with `use_double_wide_mlp` (the KV-sharing layers' twice as
wide), `attention.head_count_kv` one a layer where the config gives the full layers kv heads of their own, and
`rope.dimension_count` the full head (`_swa`: the sliding head). Tensors: first `rope_freqs` (1 on the pairs of the
full layers' heads that rotate, 1e30 on those that do not: their proportional rotary), then the model's in file order,
named by gguf-py's tensor map, the embeddings cut to the tokenizer's tokens (Gemma3Model); no norm shifted (Gemma 4
applies w, not 1 + w); `layer_scalar` and the experts' fused tensors as `.weight`s, the router's `scale` as
`ffn_gate_inp.scale` and its `per_expert_scale` as `ffn_down_exps.scale`.

The converter reads the release checkpoints' `global_head_dim` and `num_global_key_value_heads`; a config in
transformers' later `per_layer_config` spelling (which the converter itself cannot read) is read as those first.
Checked against llama.cpp's own Gemma4Model on the three tiny variants (tests/models/families.py): the same keys and
values, tensors, types and bytes (its `gemma4` tokenizer aside: bench/hf_gguf.py writes the gpt2 one)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

ARCHS = {"gemma4_text": "gemma4"}


def _release_spelling(h: dict) -> dict:
    """The full layers' head size and kv heads as the release configs spell them (`global_head_dim`,
    `num_global_key_value_heads`), from `per_layer_config` (one override, the same for every full layer)."""
    per = h.get("per_layer_config")
    if h.get("global_head_dim") is not None or not per:
        return h
    o = next(iter(per.values()))
    return {**h, "global_head_dim": o["head_dim"], "num_global_key_value_heads": o.get("num_key_value_heads")}


def tensors(h: dict, named):
    """Gemma4Model.generate_extra_tensors, then (GGUF name, tensor) of the HF tensors `named` (in file order) as
    filter_tensors and modify_tensors (Gemma4Model's, Gemma3Model's, ModelBase's) name and change them."""
    import gguf

    h = _release_spelling(h)
    full = h["rope_parameters"]["full_attention"]
    assert full["rope_type"] == "proportional"
    n_rot = int(h["global_head_dim"] * full["partial_rotary_factor"] / 2)
    yield "rope_freqs.weight", torch.tensor([1.0] * n_rot + [1e30] * (h["global_head_dim"] // 2 - n_rot))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, h["num_hidden_layers"])
    folder = Path(h["_name_or_path"])
    for name, x in named:
        x = x.to(torch.float32) if x.dtype not in (torch.float16, torch.float32) else x
        if name.endswith("layer_scalar") or (".experts." in name and not name.endswith(".weight")):
            name += ".weight"
        if name.endswith("embed_tokens.weight") and not (folder / "tokenizer.model").is_file():
            tj = json.loads((folder / "tokenizer.json").read_text())
            x = x[: len(tj["model"]["vocab"]) + len(tj["added_tokens"])]  # Gemma3Model: out-of-vocabulary rows cut
        if name.endswith("router.scale"):
            yield f"blk.{name.split('.')[2]}.ffn_gate_inp.scale", x
        elif name.endswith(".per_expert_scale"):
            yield f"blk.{name.split('.')[2]}.ffn_down_exps.scale", x
        else:
            yield names.get_name(name, try_suffixes=(".weight", ".bias")), x


def params(w, h: dict, text_params) -> None:
    """Gemma4Model.set_gguf_parameters over Gemma3Model's and TextModel's (`text_params`, then the expert counts it
    writes: the converter writes those before the head size, the one difference from its file, in order alone).
    Gemma 3's re-adds of the context, heads, epsilon, head size, base and kv heads change no value; Gemma 4's
    overwrites (head size, per-layer widths and kv heads) keep the key where it was first written, as gguf-py's
    writer does."""
    h = _release_spelling(h)
    text_params(h)
    if h.get("num_experts") is not None:
        w.add_expert_count(h["num_experts"])
    if h.get("top_k_experts") is not None:
        w.add_expert_used_count(h["top_k_experts"])
    if h.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(h["final_logit_softcapping"])
    if h.get("sliding_window_pattern") != 1:
        w.add_sliding_window(h["sliding_window"])
    n, shared = h["num_hidden_layers"], h["num_kv_shared_layers"]
    w.add_shared_kv_layers(shared)
    w.add_embedding_length_per_layer_input(h.get("hidden_size_per_layer_input") or 0)
    swa = [t == "sliding_attention" for t in h["layer_types"]]
    w.add_sliding_window_pattern(swa)
    w.add_key_length(h["global_head_dim"])
    w.add_value_length(h["global_head_dim"])
    w.add_key_length_swa(h["head_dim"])
    w.add_value_length_swa(h["head_dim"])
    if (expert_ff := h.get("expert_intermediate_size", h.get("moe_intermediate_size"))) is not None:
        w.add_expert_feed_forward_length(expert_ff)
    if h.get("use_double_wide_mlp"):
        ff = h["intermediate_size"]
        w.add_feed_forward_length([ff if i < n - shared else 2 * ff for i in range(n)])
    if (full_kv := h.get("num_global_key_value_heads")) is not None and h.get("num_key_value_heads") is not None:
        w.add_head_count_kv([h["num_key_value_heads"] if s else full_kv for s in swa])
    partial_swa = h["rope_parameters"].get("partial_rotary_factor", 1.0)  # (the top level's: none, 1.0)
    w.add_rope_dimension_count(int(h["global_head_dim"]))
    w.add_rope_dimension_count_swa(int(h["head_dim"] * partial_swa))
