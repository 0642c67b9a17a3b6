"""Qwen 3.5 (dense) as llama.cpp's converter writes it (`conversion/qwen.py`: Qwen3_5TextModel over Qwen3NextModel),
for bench/hf_gguf.py: arch `qwen35`; the delta-nets' value heads reordered from grouped by key head to tiled
(`_LinearAttentionVReorderBase`), A_log written as -exp(A_log), dt_bias as `ssm_dt.bias`, the convolution's taps
squeezed, every norm but the delta-net's output norm written as 1 + w; q_proj whole (each head's [queries | gates]);
the layer kinds only as `full_attention_interval`."""

from __future__ import annotations

import torch

ARCHS = {"qwen3_5_text": "qwen35", "qwen3_5_moe_text": "qwen35moe", "qwen3_next": "qwen3next"}  # llama.cpp's
TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "linear_attn.in_proj_qkv": "attn_qkv",
    "linear_attn.in_proj_z": "attn_gate",
    "linear_attn.in_proj_b": "ssm_beta",
    "linear_attn.in_proj_a": "ssm_alpha",
    "linear_attn.conv1d": "ssm_conv1d",
    "linear_attn.norm": "ssm_norm",
    "linear_attn.out_proj": "ssm_out",
    "linear_attn.in_proj_ba": "ssm_ba",  # Qwen3-Next's b and a, per key head
}


def _reorder(t: torch.Tensor, dim: int, nk: int, r: int, hd: int) -> torch.Tensor:
    """_reorder_v_heads: grouped [k0 v0..v(r-1), k1 ...] to tiled [k0 v0, k1 v0, ..., k0 v1, ...] along `dim`."""
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], nk, r, hd, *shape[dim + 1 :])
    return t.transpose(dim, dim + 1).contiguous().reshape(shape)


def _v_tiled(rest: str, x: torch.Tensor, h: dict) -> torch.Tensor:
    nk, nv = h["linear_num_key_heads"], h["linear_num_value_heads"]
    dk, dv, r = h["linear_key_head_dim"], h["linear_value_head_dim"], nv // nk
    if nk == nv:
        return x
    if rest == "linear_attn.in_proj_qkv.weight":
        qk = 2 * nk * dk
        return torch.cat([x[:qk], _reorder(x[qk:], 0, nk, r, dv)])
    if rest == "linear_attn.in_proj_z.weight":
        return _reorder(x, 0, nk, r, dv)
    if rest in ("linear_attn.in_proj_a.weight", "linear_attn.in_proj_b.weight"):
        return _reorder(x, 0, nk, r, 1)
    if rest in ("linear_attn.A_log", "linear_attn.dt_bias"):
        return _reorder(x.unsqueeze(-1), 0, nk, r, 1).squeeze(-1)
    if rest == "linear_attn.conv1d.weight":
        x = x.squeeze()
        qk = 2 * nk * dk
        return torch.cat([x[:qk], _reorder(x[qk:], 0, nk, r, dv)])
    if rest == "linear_attn.out_proj.weight":
        return _reorder(x, 1, nk, r, dv)
    return x


_MOE = {  # Qwen 3.5 MoE (Qwen2MoeModel's names)
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}


def _experts(h: dict, named):
    """Qwen2MoeModel.modify_tensors: a layer's experts, one tensor each, stacked into ffn_{down,gate,up}_exps once
    its last one is read; the other tensors as they come."""
    held: dict[str, dict] = {}
    for name, x in named:
        if ".mlp.experts." not in name:
            yield name, x
            continue
        bid = name.split(".")[2]
        held.setdefault(bid, {})[name] = x
        if len(held[bid]) == 3 * h["num_experts"]:
            for w in ("down_proj", "gate_proj", "up_proj"):
                parts = [held[bid][f"model.layers.{bid}.mlp.experts.{e}.{w}.weight"] for e in range(h["num_experts"])]
                yield f"blk.{bid}.ffn_{w.split('_')[0]}_exps.weight", torch.stack(parts)
            del held[bid]


def _qkvz(h: dict, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3NextModel: in_proj_qkvz (per key head [q | k | v | z]) as attn_qkv ([all q | all k | all v]) and
    attn_gate (all z), the value heads still grouped by key head."""
    nk, dk, dv = h["linear_num_key_heads"], h["linear_key_head_dim"], h["linear_value_head_dim"]
    r = h["linear_num_value_heads"] // nk
    t = x.permute(1, 0).contiguous().view(-1, nk, 2 * dk + 2 * r * dv)
    q, k, v, z = (p.contiguous().view(x.shape[1], -1) for p in torch.split(t, [dk, dk, r * dv, r * dv], dim=-1))
    return torch.cat([q, k, v], dim=-1).permute(1, 0).contiguous(), z.permute(1, 0).contiguous()


def tensors(h: dict, named):
    """(GGUF name, tensor) of the HF tensors `named` ((name, tensor) in file order)."""
    nxt = h["model_type"] == "qwen3_next"  # Qwen3NextModel itself: fused projections, no value heads reordered
    for name, x in _experts(h, named):
        if name.startswith("blk."):  # a layer's experts, stacked
            yield name, x.to(torch.float32)
            continue
        x = x.to(torch.float32)
        if name in ("lm_head.weight",) and h.get("tie_word_embeddings"):
            continue
        module, _, suffix = name.rpartition(".")
        if module in TOP:
            yield f"{TOP[module]}.{suffix}", x + 1 if module == "model.norm" else x
            continue
        _, _, bid, rest = name.split(".", 3)
        if nxt and rest == "linear_attn.in_proj_qkvz.weight":
            qkv, z = _qkvz(h, x)
            yield f"blk.{bid}.attn_qkv.weight", qkv
            yield f"blk.{bid}.attn_gate.weight", z
            continue
        x = x if nxt else _v_tiled(rest, x, h)
        if rest.endswith("A_log"):
            yield f"blk.{bid}.ssm_a", -torch.exp(x)
            continue
        if rest.endswith("dt_bias"):
            yield f"blk.{bid}.ssm_dt.bias", x
            continue
        if "conv1d" in rest:
            x = x.squeeze()
        if rest.endswith("norm.weight") and not rest.endswith("linear_attn.norm.weight"):
            x = x + 1
        module = rest.rpartition(".")[0]
        yield f"blk.{bid}.{_LAYER.get(module) or _MOE[module]}.{suffix}", x


def params(w, h: dict, text_params) -> None:
    """Qwen3NextModel's keys beside TextModel's (`text_params`): the delta-nets' sizes, the attention interval, the
    rotary dims of a head (a quarter), the multimodal rope's sections; the multi-token prediction layers counted among
    the blocks."""
    mtp = int(h.get("mtp_num_hidden_layers") or 0)
    text_params({**h, "num_hidden_layers": h["num_hidden_layers"] + mtp})
    w.add_ssm_conv_kernel(h["linear_conv_kernel_dim"])
    w.add_ssm_state_size(h["linear_key_head_dim"])
    w.add_ssm_group_count(h["linear_num_key_heads"])
    w.add_ssm_time_step_rank(h["linear_num_value_heads"])
    w.add_ssm_inner_size(h["linear_value_head_dim"] * h["linear_num_value_heads"])
    w.add_full_attention_interval(h.get("full_attention_interval", 4))
    head_dim = h.get("head_dim") or h["hidden_size"] // h["num_attention_heads"]
    w.add_rope_dimension_count(int(head_dim * h.get("partial_rotary_factor", 0.25)))
    if h["model_type"] != "qwen3_next":  # _Qwen35MRopeMixin
        sections = list((h.get("rope_parameters") or {}).get("mrope_section") or [11, 11, 10])
        w.add_rope_dimension_sections(sections + [0] * (4 - len(sections)))
    if h.get("num_experts"):  # TextModel's expert counts, Qwen2MoeModel's widths
        w.add_expert_count(h["num_experts"])
        w.add_expert_used_count(h["num_experts_per_tok"])
        w.add_expert_feed_forward_length(h["moe_intermediate_size"])
        w.add_expert_shared_feed_forward_length(h["shared_expert_intermediate_size"])
    if mtp:
        w.add_nextn_predict_layers(mtp)
