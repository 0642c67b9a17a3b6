"""Mistral 4 (`mistral4`, the text model of Mistral Small 4's multimodal checkpoint): multi-head latent attention
(models/mla.py) with YaRN on a rotary part of each head taken in interleaved pairs, queries scaled by position
(as Ministral 3's), a softmax scale of qk_head_dim^-0.5 times YaRN's mscale squared; its FFNs past
`first_k_dense_replace` experts chosen by softmax scores (top k renormalised and scaled) beside an ungated shared
expert. The rotary rows of the query and key projections are reordered as read: each head's [rope | nope], the
interleaved pairs as halves (the same dot products)."""

from __future__ import annotations

import math

import numpy as np

from models.families.base import MOE_HF_KEYS, Family, Unsupported
from models.mla import lanes

_KEYS = MOE_HF_KEYS | frozenset(
    "n_shared_experts n_routed_experts routed_scaling_factor n_group topk_group first_k_dense_replace kv_lora_rank "
    "q_lora_rank qk_rope_head_dim v_head_dim qk_nope_head_dim rope_interleave qk_head_dim".split()
)


def _mscale(factor: float, m: float) -> float:
    return 1.0 if factor <= 1 or not m else 0.1 * m * math.log(factor) + 1.0


def _hf(cfg: dict, a: dict) -> dict:
    nope, rope, v = int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"]), int(cfg["v_head_dim"])
    if v != nope + rope:
        raise Unsupported(f"v_head_dim={v} unlike the keys' {nope + rope} (values and keys of different sizes)")
    if not cfg.get("q_lora_rank") or not cfg.get("rope_interleave", True):
        raise Unsupported("q_lora_rank: null or rope_interleave: false (Mistral 4 as released has neither)")
    if cfg.get("attention_bias"):
        raise Unsupported("attention_bias: true (biases on the latent attention's projections)")
    groups, top = int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)
    if top < groups:
        raise Unsupported(f"n_group={groups}, topk_group={top} (group-limited routing)")
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    scale = (nope + rope) ** -0.5
    if params.get("rope_type", params.get("type")) == "yarn" and params.get("mscale_all_dim"):
        scale *= _mscale(float(params["factor"]), float(params["mscale_all_dim"])) ** 2
    beta = float(params.get("llama_4_scaling_beta") or 0.0)
    temp = {"attn_temp_beta": beta, "attn_temp_scale": float(params["original_max_position_embeddings"])}
    return {
        "head_dim": nope + rope,
        "n_kv_heads": a["n_heads"],
        "rope_dim": rope,
        "attn_scale": scale,
        "mla_kv_rank": int(cfg["kv_lora_rank"]),
        "mla_q_rank": int(cfg.get("q_lora_rank") or 0),
        **(temp if beta else {}),
        "dense_layers": tuple(range(int(cfg.get("first_k_dense_replace") or 0))),
        "routed_scale": float(cfg.get("routed_scaling_factor") or 1.0),
        "norm_topk": bool(cfg.get("norm_topk_prob", True)),
        "norm_topk_eps": 1e-20,
        "shared_ffn_dim": int(cfg["moe_intermediate_size"]) * int(cfg.get("n_shared_experts") or 0),
        "shared_gated": False,
    }


def _halves(rows: np.ndarray) -> np.ndarray:
    """Rotary rows in interleaved pairs (x0, x1), (x2, x3)... as halves (x0, x2, ... | x1, x3, ...)."""
    return np.concatenate([rows[0::2], rows[1::2]])


def _split(name: str, src: str, w: np.ndarray, args) -> np.ndarray:
    """Each head's query rows [nope | rope] in the lanes models/mla.py puts the keys' (the rotary part as halves);
    the shared rotary key rows of kv_a as halves."""
    R, D = args.rope_dim, args.head_dim
    if name.endswith(".attn_q"):
        heads, out = w.reshape(args.n_heads, D, -1), np.empty((args.n_heads, D, w.shape[1]), dtype=w.dtype)
        rot, nope = lanes(D, R)
        out[:, rot] = np.stack([_halves(h[D - R :]) for h in heads])
        out[:, nope] = heads[:, : D - R]
        return out.reshape(w.shape)
    if name.endswith(".attn_kv_a"):
        return np.concatenate([w[: args.mla_kv_rank], _halves(w[args.mla_kv_rank :])])
    return w


MISTRAL4 = Family(
    "mistral4",
    hf_types=("mistral4",),
    gguf_archs=(),
    hf_defaults={"rope_theta": 10000.0, "rope_interleave": True},
    hf_keys=_KEYS,
    hf_fields=_hf,
    hf_names={
        "attn_q_a": ("self_attn.q_a_proj",),
        "attn_q_a_norm": ("self_attn.q_a_layernorm",),
        "attn_q": ("self_attn.q_b_proj",),
        "attn_kv_a": ("self_attn.kv_a_proj_with_mqa",),
        "attn_kv_a_norm": ("self_attn.kv_a_layernorm",),
        "attn_kv_b": ("self_attn.kv_b_proj",),
        "ffn_shexp_gate_up": ("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj"),
        "ffn_shexp_down": ("mlp.shared_experts.down_proj",),
    },
    hf_split=_split,
)
