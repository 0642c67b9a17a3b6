"""GLM-4.5 as llama.cpp's converter writes it (`conversion/glm.py`: Glm4MoeModel), for bench/hf_gguf.py: arch
`glm4moe`; q/k not permuted (GLM-4.5 rotates NeoX halves, as llama.cpp runs it); a layer's experts stacked into
ffn_{down,gate,up}_exps once its last one is read, the router's choosing bias as `exp_probs_b.bias`, the pre-FFN
norm as `post_attention_norm`, the multi-token prediction layer (`model.layers.<n_layers>`) kept as one more block
(its own tensors as `blk.<n>.nextn.*`); the names gguf-py's tensor map gives. Keys: TextModel's with the blocks
counting that layer, its expert counts and groups; the rotary dims (half a head), the experts' width, the shared
experts, the leading dense layers, a sigmoid gating, `routed_scaling_factor` as `expert_weights_scale`,
`norm_topk_prob` as `expert_weights_norm`, `nextn_predict_layers`. (Its vocabulary's GLM special tokens are not
reproduced: the tiny tokenizers have none.)"""

from __future__ import annotations

import torch

ARCHS = {"glm4_moe": "glm4moe"}


def _blocks(h: dict) -> int:
    """Glm4MoeModel.block_count: the layers and the prediction layers after them."""
    return h["num_hidden_layers"] + h.get("num_nextn_predict_layers", 0)


def tensors(h: dict, named):
    """(GGUF name, tensor) for each of the model's (name, tensor) in the file's order."""
    import gguf

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GLM4_MOE, _blocks(h))

    def put(name: str, x: torch.Tensor):
        return names.get_name(name, try_suffixes=(".weight", ".bias")), x

    n_experts, held = h["n_routed_experts"], {}
    for name, x in named:
        name = name.replace("e_score_correction_bias", "e_score_correction.bias")  # ModelBase.filter_tensors
        x = x.to(torch.float32) if x.dtype not in (torch.float16, torch.float32) else x
        if name == "model.embed_tokens.weight":
            yield "token_embd.weight", x
        elif "mlp.experts" in name:
            bid = name.split(".")[2]
            held.setdefault(bid, {})[name] = x
            if len(held[bid]) >= 3 * n_experts:
                for w in ("down_proj", "gate_proj", "up_proj"):
                    parts = [held[bid].pop(f"model.layers.{bid}.mlp.experts.{e}.{w}.weight") for e in range(n_experts)]
                    yield put(f"model.layers.{bid}.mlp.experts.{w}.weight", torch.stack(parts))
        else:
            yield put(name, x)


def params(w, h: dict, text_params) -> None:
    """Glm4MoeModel.set_gguf_parameters over TextModel's (`text_params(hh)`, the expert counts and groups after it)."""
    import gguf

    text_params({**h, "num_hidden_layers": _blocks(h)})
    w.add_expert_count(h["n_routed_experts"])
    w.add_expert_used_count(h["num_experts_per_tok"])
    if h.get("n_group") is not None:
        w.add_expert_group_count(h["n_group"])
    if h.get("topk_group") is not None:
        w.add_expert_group_used_count(h["topk_group"])
    head_dim = h.get("head_dim") or h["hidden_size"] // h["num_attention_heads"]
    rope = h.get("rope_parameters") or {}
    w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", h.get("partial_rotary_factor", 0.5))))
    w.add_expert_feed_forward_length(h["moe_intermediate_size"])
    if h.get("n_shared_experts") is not None:
        w.add_expert_shared_count(h["n_shared_experts"])
    if h.get("first_k_dense_replace") is not None:
        w.add_leading_dense_block_count(h["first_k_dense_replace"])
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if h.get("routed_scaling_factor") is not None:
        w.add_expert_weights_scale(h["routed_scaling_factor"])
    if h.get("norm_topk_prob") is not None:
        w.add_expert_weights_norm(h["norm_topk_prob"])
    if h.get("num_nextn_predict_layers") is not None:
        w.add_nextn_predict_layers(h["num_nextn_predict_layers"])
