"""LFM2 and LFM2-MoE as llama.cpp's converter writes them (`conversion/lfm2.py`: LFM2Model, LFM2MoeModel), for
bench/hf_gguf.py: archs `lfm2`, `lfm2moe`; their kv heads a layer (0 for a convolution layer), the convolution's taps
[C, 1, K] as [C, K], LFM2's FFN width adjusted; LFM2-MoE's experts, a layer's stacked into
ffn_{gate,down,up}_exps (w1, w2, w3) once its last one is read, the router's choosing bias as `exp_probs_b.bias`;
the expert counts, their width, the dense layers leading and a sigmoid gating as keys. `routed_scaling_factor` is
not written (llama.cpp's lfm2moe runs without one)."""

from __future__ import annotations

import torch

ARCHS = {"lfm2": "lfm2", "lfm2_moe": "lfm2moe"}
_TOP = {"model.embed_tokens": "token_embd", "model.embedding_norm": "token_embd_norm", "lm_head": "output"}
_LAYER = {
    **{"operator_norm": "attn_norm", "ffn_norm": "ffn_norm", "self_attn.out_proj": "attn_output"},
    **{"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v"},
    **{"self_attn.q_layernorm": "attn_q_norm", "self_attn.k_layernorm": "attn_k_norm", "conv.conv": "shortconv.conv"},
    **{"feed_forward.w1": "ffn_gate", "feed_forward.w3": "ffn_up", "feed_forward.w2": "ffn_down"},
    **{"conv.in_proj": "shortconv.in_proj", "conv.out_proj": "shortconv.out_proj"},
    **{"feed_forward.gate": "ffn_gate_inp", "feed_forward.expert_bias": "exp_probs_b"},
}
_EXPERTS = {"w1": "ffn_gate_exps", "w2": "ffn_down_exps", "w3": "ffn_up_exps"}


def tensors(h: dict, named):
    """(GGUF name, tensor) of the HF tensors `named` ((name, tensor) in file order)."""
    held: dict[str, dict] = {}
    for name, x in named:
        x = x.to(torch.float32)
        if ".feed_forward.experts." in name:
            bid = name.split(".")[2]
            held.setdefault(bid, {})[name] = x
            if len(held[bid]) == 3 * h["num_experts"]:
                for w, gguf_name in _EXPERTS.items():
                    parts = [
                        held[bid][f"model.layers.{bid}.feed_forward.experts.{e}.{w}.weight"]
                        for e in range(h["num_experts"])
                    ]
                    yield f"blk.{bid}.{gguf_name}.weight", torch.stack(parts)
                del held[bid]
        elif (top := name.rpartition(".")[0]) in _TOP:
            yield f"{_TOP[top]}.{name.rpartition('.')[2]}", x
        else:
            _, _, bid, rest = name.split(".", 3)
            module, _, suffix = rest.rpartition(".")
            if rest == "feed_forward.expert_bias":  # LFM2MoeModel.filter_tensors: a bias of its own
                module, suffix = rest, "bias"
            yield f"blk.{bid}.{_LAYER[module]}.{suffix}", x.squeeze(1) if module == "conv.conv" else x


def params(w, h: dict, text_params) -> None:
    """LFM2Model.set_gguf_parameters (`text_params(h)`: TextModel's, given): kv heads a layer (0: a convolution layer),
    the taps, the FFN's width (LFM2's adjusted; LFM2-MoE's as given); and LFM2MoeModel's expert keys."""
    ff = h["block_ff_dim"] if h.get("block_ff_dim") is not None else h["intermediate_size"]
    if h.get("block_auto_adjust_ff_dim") and h["model_type"] == "lfm2":
        ff = int(2 * ff / 3)
        if h.get("block_ffn_dim_multiplier") is not None:
            ff = int(h["block_ffn_dim_multiplier"] * ff)
        ff = h["block_multiple_of"] * ((ff + h["block_multiple_of"] - 1) // h["block_multiple_of"])
    kv = [h["num_key_value_heads"] * (t != "conv") for t in h["layer_types"]]
    text_params({**h, "num_key_value_heads": kv, "rms_norm_eps": h["norm_eps"], "intermediate_size": ff})
    w.add_vocab_size(h["vocab_size"])
    w.add_shortconv_l_cache(h["conv_L_cache"])
    if h["model_type"] != "lfm2_moe":
        return
    w.add_expert_count(h["num_experts"])
    w.add_expert_used_count(h["num_experts_per_tok"])
    w.add_expert_feed_forward_length(h["moe_intermediate_size"])
    w.add_leading_dense_block_count(h["num_dense_layers"])
    import gguf

    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
