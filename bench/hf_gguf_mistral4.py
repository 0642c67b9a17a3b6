"""Mistral 4 as llama.cpp's converter writes it (`conversion/mistral3.py`: Mistral3Model.Mistral4Model, a
DeepseekV2Model of `conversion/deepseek.py`), for bench/hf_gguf.py: arch `mistral4`; the latent attention's tensors
under gguf-py's names, q_b and kv_a as HF has them (no permutation), kv_b split per head into k_b (transposed:
[heads, rank, nope]) and v_b ([heads, v, rank]); the experts as HF stacks them (`ffn_gate_up_exps`, gate rows first,
and `ffn_down_exps`); the keys of MLA written as MQA: one kv head, `key_length` and `value_length` the latent's, the
heads' own as `key_length_mla` / `value_length_mla`, the ranks, the leading dense layers, the experts' width, shared
count, scale and renormalisation, `rope.dimension_count` the rotary part, and YaRN's mscale_all_dim as a tenth of it
(`yarn_log_multiplier`). The position scaling of the queries (`llama_4_scaling_beta`) is not written."""

from __future__ import annotations

import torch

ARCHS = {"mistral4": "mistral4"}


def _kv_b(h: dict, name: str, x: torch.Tensor):
    """DeepseekV2Model.modify_tensors: kv_b [heads x (nope + v), rank] as k_b [heads, rank, nope] and v_b."""
    nope, v = h["qk_nope_head_dim"], h["v_head_dim"]
    assert x.shape[0] == h["num_key_value_heads"] * (nope + v)  # (read before set_gguf_parameters sets it to 1)
    k_b, v_b = torch.split(x.view(h["num_key_value_heads"], nope + v, x.shape[-1]), [nope, v], dim=1)
    yield name.replace("kv_b_proj", "k_b_proj"), k_b.transpose(1, 2)
    yield name.replace("kv_b_proj", "v_b_proj"), v_b


def tensors(h: dict, named):
    """(GGUF name, tensor) for each of the model's (name, tensor) in the file's order."""
    import gguf

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MISTRAL4, h["num_hidden_layers"])
    for name, x in named:
        x = x.to(torch.float32) if x.dtype not in (torch.float16, torch.float32) else x
        name = name.replace("language_model.", "")  # ModelBase.filter_tensors (the multimodal checkpoint's)
        if h.get("tie_word_embeddings") and name in ("lm_head.weight", "model.lm_head.weight"):
            continue
        if name.endswith((".down_proj", ".gate_up_proj")):  # Mistral4Model: the stacked experts, named as weights
            name += ".weight"
        parts = _kv_b(h, name, x) if name.endswith("kv_b_proj.weight") else [(name, x)]
        for n, t in parts:
            if (gguf_name := names.get_name(n, try_suffixes=(".weight", ".bias"))) is None:
                raise ValueError(f"Can not map tensor {n!r}")  # ModelBase.map_tensor_name
            yield gguf_name, t


def _find(h: dict, *keys):
    """TextModel.find_hparam: the value of the first of the keys the config has."""
    return next((h[k] for k in keys if k in h), None)


def params(w, h: dict, text_params) -> None:
    """DeepseekV2Model.set_gguf_parameters: TextModel's with one kv head (`text_params`, then its expert keys and
    head_dim's lengths before the file type, as TextModel orders them), then the latent attention's and experts'."""
    text_params({**h, "num_key_value_heads": 1, "head_dim": None})
    ftype = w.kv_data[0].pop("general.file_type").value  # TextModel writes it last: after the keys below
    import gguf

    if (n := _find(h, "num_local_experts", "num_experts", "n_routed_experts")) is not None:
        w.add_expert_count(n)
    if (n := _find(h, "num_experts_per_tok", "num_experts_per_token", "top_k_experts")) is not None:
        w.add_expert_used_count(n)
    if h.get("n_group") is not None:
        w.add_expert_group_count(h["n_group"])
    if h.get("topk_group") is not None:
        w.add_expert_group_used_count(h["topk_group"])
    score = _find(h, *"score_function scoring_func score_func moe_router_activation moe_router_activation_func".split())
    if score is not None:  # (Mistral 4's config names none: llama.cpp's default, softmax)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType[score.upper()])
    if h.get("head_dim") is not None:
        w.add_key_length(h["head_dim"])
        w.add_value_length(h["head_dim"])
    w.add_file_type(ftype)
    dense = h.get("first_k_dense_replace")
    if dense is None:  # all layers dense without experts, else none
        dense = h["num_hidden_layers"] if h.get("n_routed_experts") is None else 0
    w.add_leading_dense_block_count(dense)
    w.add_vocab_size(h["vocab_size"])
    if h.get("q_lora_rank") is not None:
        w.add_q_lora_rank(h["q_lora_rank"])
    rank, rope = h.get("kv_lora_rank", 512), h["qk_rope_head_dim"]
    w.add_kv_lora_rank(rank)
    w.add_key_length(rank + rope)  # (overwriting head_dim's, in its place)
    w.add_value_length(rank)
    w.add_key_length_mla(h["qk_nope_head_dim"] + rope)
    w.add_value_length_mla(h["v_head_dim"])
    w.add_expert_feed_forward_length(_find(h, "moe_intermediate_size", "intermediate_size"))
    if h.get("n_routed_experts") is not None:
        w.add_expert_count(h["n_routed_experts"])
    w.add_expert_shared_count(h.get("n_shared_experts", 0))
    if h.get("routed_scaling_factor") is not None:
        w.add_expert_weights_scale(h["routed_scaling_factor"])
    if h.get("norm_topk_prob"):
        w.add_expert_weights_norm(h["norm_topk_prob"])
    w.add_rope_dimension_count(rope)
    rp = h.get("rope_parameters", h.get("rope_scaling")) or {}
    if rp.get("mscale_all_dim") is not None:
        w.add_rope_scaling_yarn_log_mul(0.1 * rp["mscale_all_dim"])
