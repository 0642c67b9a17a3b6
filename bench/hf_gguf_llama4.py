"""Llama 4's text model as llama.cpp's converter writes it (`conversion/llama.py`: Llama4Model over LlamaModel), for
bench/hf_gguf.py: arch `llama4`; q/k not permuted (`undo_permute = False`: Llama 4 rotates interleaved pairs, as
llama.cpp's NORM rope does); the fused experts' gate_up [experts, in, 2 ff] transposed and split in halves (gate
first) into ffn_gate_exps and ffn_up_exps, down transposed to [experts, out, in]; a Llama 3 rope's divisors as
`rope_freqs.weight` first; the names gguf-py's tensor map gives. Keys: TextModel's with the dense FFN's width
(`intermediate_size_mlp`) as `feed_forward_length`, the expert counts, LlamaModel's vocabulary size and rotary
dims, `interleave_moe_layer_step`, the experts' width, and a window of 0 where every layer is full. Nothing of the
chunk size, the NoPE layers or the temperature is written: llama.cpp fixes them for every Llama 4."""

from __future__ import annotations

import math

import torch

ARCHS = {"llama4_text": "llama4"}


def _rope_freqs(h: dict):
    """LlamaModel.generate_extra_tensors: a `llama3` rope's per-frequency divisors (its arithmetic, float32 tensors)."""
    rp = h.get("rope_parameters") or h.get("rope_scaling") or {}
    rp = rp.get("full_attention", rp)
    if rp.get("rope_type", "").lower() != "llama3":
        return
    yield "rope_freqs.weight", llama3_divisors(h, rp, rp.get("rope_theta", h.get("rope_theta", 10000.0)))


def llama3_divisors(h: dict, rp: dict, base: float) -> torch.Tensor:
    """A `llama3` rope's per-frequency divisors as LlamaModel writes them (its arithmetic on float32 tensors, for the
    same bytes): `rp` its rope parameters, `base` its theta (bench/hf_gguf.py's Llama 3.x use them too)."""
    dim = h.get("head_dim") or h["hidden_size"] // h["num_attention_heads"]
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, lo, hi = rp.get("factor", 8.0), rp.get("low_freq_factor", 1.0), rp.get("high_freq_factor", 4.0)
    old = rp.get("original_max_position_embeddings", 8192)
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / hi:
            factors.append(1)
        elif wavelen > old / lo:
            factors.append(factor)
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32)


def tensors(h: dict, named):
    """(GGUF name, tensor) for each of the model's (name, tensor) in the file's order, after the rope divisors."""
    import gguf

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA4, h["num_hidden_layers"])

    def put(name: str, x: torch.Tensor):
        return names.get_name(name, try_suffixes=(".weight", ".bias")), x

    yield from _rope_freqs(h)
    for name, x in named:
        name = name.replace("language_model.", "")  # ModelBase.filter_tensors (the multimodal checkpoint's)
        x = x.to(torch.float32) if x.dtype not in (torch.float16, torch.float32) else x
        if "gate_up_proj" in name:
            gate, up = x.transpose(-1, -2).split(x.shape[-1] // 2, dim=-2)
            yield put(name.replace("gate_up_proj", "gate_proj.weight"), gate)
            yield put(name.replace("gate_up_proj", "up_proj.weight"), up)
        elif name.endswith("down_proj"):
            yield put(name + ".weight", x.transpose(-1, -2))
        else:
            yield put(name, x)


def params(w, h: dict, text_params) -> None:
    """Llama4Model.set_gguf_parameters over LlamaModel's and TextModel's (`text_params(hh)`): the dense FFN's width as
    `feed_forward_length`, the experts' as `expert_feed_forward_length`."""
    text_params({**h, "intermediate_size": h["intermediate_size_mlp"]})
    w.add_expert_count(h["num_local_experts"])
    w.add_expert_used_count(h["num_experts_per_tok"])
    w.add_vocab_size(h["vocab_size"])
    w.add_rope_dimension_count(h.get("head_dim") or h["hidden_size"] // h["num_attention_heads"])
    w.add_interleave_moe_layer_step(h["interleave_moe_layer_step"])
    w.add_expert_feed_forward_length(h["intermediate_size"])
    if "layer_types" in h and all(t == "full_attention" for t in h["layer_types"]):
        w.add_sliding_window(0)  # (MobileLLM's: llama.cpp then runs no chunks)
