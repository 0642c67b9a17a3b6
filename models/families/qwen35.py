"""Qwen 3.5, dense and mixture of experts: gated delta-net layers (`linear_attention`: a short convolution over q/k/v, then a recurrent
state; models/recurrent.py) among full-attention layers, one in `full_attention_interval` (4). The attention layers
gate their output by sigmoid of a second half of q_proj (each head's [queries | gates]), have q/k norms per head and a
partial rotary (a quarter of each head). Every RMSNorm is applied as `1 + w`, but the delta-net's gated output norm
(plain w). The released checkpoints wrap it with a vision tower (`Qwen3_5ForConditionalGeneration`): cadence runs the
text model; its multi-token prediction head (`mtp.*`) is left aside. For text alone the multimodal rope's sections
rotate as one: a plain partial rotary. The mixture of experts (`qwen3_5_moe`) routes by a softmax, its top k
renormalised, beside a shared expert gated by sigmoid (Qwen2-MoE's FFN). Qwen3-Next is the same model with its
delta-nets' projections fused and grouped by key head (`in_proj_qkvz`: per key head [q | k | its value heads' v |
their z]; `in_proj_ba`: [b | a]), put back in Qwen 3.5's order as read."""

from __future__ import annotations

import numpy as np

import dataclasses

from models.families.base import MOE_HF_KEYS, Family, Unsupported, hybrid_kinds

_KEYS = frozenset(
    "linear_conv_kernel_dim linear_key_head_dim linear_value_head_dim linear_num_key_heads linear_num_value_heads "
    "full_attention_interval attn_output_gate mtp_num_hidden_layers mtp_use_dedicated_embeddings".split()
)


def _hf(cfg: dict, a: dict) -> dict:
    if cfg.get("attn_output_gate") is False:
        raise Unsupported("attn_output_gate: false (attention without its output gate)")
    n = a["n_layers"]
    every = int(cfg.get("full_attention_interval") or 4)
    kind = lambda i: "linear_attention" if (i + 1) % every else "full_attention"  # noqa: E731
    types = hybrid_kinds(cfg, n, {"linear_attention", "full_attention"}, kind)
    return {
        "gdn_layers": tuple(i for i, t in enumerate(types) if t == "linear_attention"),
        "gdn_k_heads": int(cfg["linear_num_key_heads"]),
        "gdn_v_heads": int(cfg["linear_num_value_heads"]),
        "gdn_k_dim": int(cfg["linear_key_head_dim"]),
        "gdn_v_dim": int(cfg["linear_value_head_dim"]),
        "conv_kernel": int(cfg["linear_conv_kernel_dim"]),
    }


def _split(name: str, src: str, w: np.ndarray, args) -> np.ndarray:
    """q_proj holds each head's [queries | gates]: attn_qkv takes the queries, attn_gate the gates."""
    if not src.endswith("q_proj.weight"):
        return w
    heads = w.reshape(args.n_heads, 2, args.head_dim, *w.shape[1:])
    return heads[:, 1 if name.endswith("attn_gate") else 0].reshape(args.q_dim, *w.shape[1:])


def _gguf(key, a: dict) -> dict:
    """llama.cpp's qwen35: the layer kinds from the attention interval; the multi-token prediction layers (counted
    among the blocks) left aside."""
    n, every, nv = (
        a["n_layers"] - int(key("nextn_predict_layers", 0) or 0),
        int(key("full_attention_interval", 4)),
        int(key("ssm.time_step_rank")),
    )
    return {
        "n_layers": n,
        "gdn_layers": tuple(i for i in range(n) if (i + 1) % every),
        "gdn_k_heads": int(key("ssm.group_count")),
        "gdn_v_heads": nv,
        "gdn_k_dim": int(key("ssm.state_size")),
        "gdn_v_dim": int(key("ssm.inner_size")) // nv,
        "conv_kernel": int(key("ssm.conv_kernel")),
    }


def _grouped(w: np.ndarray, axis: int, nk: int, r: int, hd: int) -> np.ndarray:
    """Value heads tiled [k0 v0, k1 v0, ..., k0 v1, ...] (llama.cpp's order) grouped again by key head along `axis`."""
    shape = w.shape
    t = w.reshape(*shape[:axis], r, nk, hd, *shape[axis + 1 :])
    return np.ascontiguousarray(np.swapaxes(t, axis, axis + 1)).reshape(shape)


def _gguf_split(name: str, src: str, w: np.ndarray, args) -> np.ndarray:
    """A GGUF tensor of llama.cpp's qwen35 in HF's layout: q_proj's halves; the delta-nets' value heads grouped by key
    head again (when there are more of them than key heads); A_log from -exp(A_log)."""
    if src.endswith("attn_q.weight"):
        return _split(name, "q_proj.weight", w, args)
    if not src.startswith("blk."):  # the embeddings, the final norm
        return w
    nk, nv, dk, dv = args.gdn_k_heads, args.gdn_v_heads, args.gdn_k_dim, args.gdn_v_dim
    part, r = src.split(".")[2], nv // max(nk, 1)
    if nk and nk != nv and int(src.split(".")[1]) in args.gdn_layers:
        qk = 2 * nk * dk
        if part in ("attn_qkv", "ssm_conv1d"):
            w = np.concatenate([w[:qk], _grouped(w[qk:], 0, nk, r, dv)])
        elif part == "attn_gate":
            w = _grouped(w, 0, nk, r, dv)
        elif part in ("ssm_beta", "ssm_alpha", "ssm_a", "ssm_dt"):
            w = _grouped(w, 0, nk, r, 1)
        elif part == "ssm_out":
            w = _grouped(w, 1, nk, r, dv)
    return np.log(-w) if part == "ssm_a" else w


QWEN3_5 = Family(
    "qwen3_5",
    hf_types=("qwen3_5_text",),
    gguf_archs=("qwen35",),
    gguf_keys=frozenset(
        "ssm.conv_kernel ssm.state_size ssm.group_count ssm.time_step_rank ssm.inner_size full_attention_interval "
        "rope.dimension_sections nextn_predict_layers".split()
    ),
    gguf_fields=_gguf,
    gguf_names={
        "ffn_norm": ("post_attention_norm",),
        "attn_gate": ("attn_q",),
        "gdn_in": ("attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha"),
        "gdn_conv": ("ssm_conv1d",),
        "gdn_dt": ("ssm_dt.bias",),
        "gdn_a": ("ssm_a",),
        "gdn_norm": ("ssm_norm",),
        "gdn_out": ("ssm_out",),
    },
    gguf_split=_gguf_split,
    gguf_params=frozenset({"gdn_dt", "gdn_a"}),
    block={"qk_norm": "head", "attn_gate": True},
    hf_defaults={"rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25, "linear_conv_kernel_dim": 4},
    hf_keys=_KEYS,
    hf_fields=_hf,
    hf_norm_shift=1.0,
    hf_names={
        "attn_gate": ("self_attn.q_proj",),
        "gdn_in": (
            "linear_attn.in_proj_qkv",
            "linear_attn.in_proj_z",
            "linear_attn.in_proj_b",
            "linear_attn.in_proj_a",
        ),
        "gdn_conv": ("linear_attn.conv1d",),
        "gdn_dt": ("linear_attn.dt_bias",),
        "gdn_a": ("linear_attn.A_log",),
        "gdn_norm": ("linear_attn.norm",),
        "gdn_out": ("linear_attn.out_proj",),
    },
    hf_params=frozenset({"gdn_dt", "gdn_a"}),
    hf_split=_split,
)

QWEN3_5_MOE = dataclasses.replace(
    QWEN3_5,
    name="qwen3_5_moe",
    hf_types=("qwen3_5_moe_text",),
    gguf_archs=("qwen35moe",),
    gguf_fields=lambda key, a: {**_gguf(key, a), "norm_topk": True},  # llama.cpp's qwen35moe: the top k renormalised
    hf_keys=QWEN3_5.hf_keys | MOE_HF_KEYS | {"shared_expert_intermediate_size"},
    hf_fields=lambda cfg, a: {**_hf(cfg, a), "norm_topk": True},
    # no dense FFN: the experts' width stands for it
    hf_config=lambda cfg: {"intermediate_size": cfg.get("moe_intermediate_size"), **cfg},
    shared_expert=True,
)


def _next_split(name: str, src: str, w: np.ndarray, args) -> np.ndarray:
    """Qwen3-Next's fused delta-net projections, grouped by key head, as Qwen 3.5's [q | k | v | z] and [b | a]."""
    hk, dk, r, dv = args.gdn_k_heads, args.gdn_k_dim, args.gdn_v_heads // args.gdn_k_heads, args.gdn_v_dim
    if src.endswith("in_proj_qkvz.weight"):
        g = w.reshape(hk, 2 * dk + 2 * r * dv, -1)
        parts = np.split(g, [dk, 2 * dk, 2 * dk + r * dv], axis=1)  # q, k, v, z of each key head
        return np.concatenate([p.reshape(-1, w.shape[-1]) for p in parts])
    if src.endswith("in_proj_ba.weight"):
        g = w.reshape(hk, 2 * r, -1)
        return np.concatenate([g[:, :r].reshape(-1, w.shape[-1]), g[:, r:].reshape(-1, w.shape[-1])])
    return _split(name, src, w, args)


def _next_gguf_split(name: str, src: str, w: np.ndarray, args) -> np.ndarray:
    """llama.cpp's qwen3next in HF's layout: q_proj's halves, each key head's [b | a] as all b then all a, A_log from
    -exp(A_log); its value heads are grouped by key head as they are here."""
    part = src.split(".")[2] if src.startswith("blk.") else ""
    if part == "attn_q":
        return _split(name, "q_proj.weight", w, args)
    if part == "ssm_ba":
        g = w.reshape(args.gdn_k_heads, 2, args.gdn_v_heads // args.gdn_k_heads, -1)
        return np.concatenate([g[:, 0].reshape(-1, w.shape[-1]), g[:, 1].reshape(-1, w.shape[-1])])
    return np.log(-w) if part == "ssm_a" else w


QWEN3_NEXT = dataclasses.replace(
    QWEN3_5_MOE,
    name="qwen3_next",
    hf_types=("qwen3_next",),
    gguf_archs=("qwen3next",),
    gguf_names={**QWEN3_5.gguf_names, "gdn_in": ("attn_qkv", "attn_gate", "ssm_ba")},
    gguf_split=_next_gguf_split,
    hf_keys=QWEN3_5_MOE.hf_keys | {"decoder_sparse_step", "mlp_only_layers"},
    hf_config=lambda cfg: cfg,
    hf_names={**QWEN3_5.hf_names, "gdn_in": ("linear_attn.in_proj_qkvz", "linear_attn.in_proj_ba")},
    hf_split=_next_split,
)
