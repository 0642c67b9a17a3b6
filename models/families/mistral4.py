"""Mistral 4 (`mistral4`, the text model of Mistral Small 4's multimodal checkpoint): multi-head latent attention
(models/mla.py) with YaRN on a rotary part of each head taken in interleaved pairs, queries scaled by position
(as Ministral 3's), a softmax scale of qk_head_dim^-0.5 times YaRN's mscale squared; its FFNs past
`first_k_dense_replace` experts chosen by softmax scores (top k renormalised and scaled) beside an ungated shared
expert. The rotary rows of the query and key projections are reordered as read: each head's [rope | nope], the
interleaved pairs as halves (the same dot products).

llama.cpp's converter writes it as arch `mistral4` (its DeepSeek-2 reader): the latent attention as MQA (one kv head,
`key_length` and `value_length` the latent's; the heads' own as `_mla` keys), q_b and kv_a as HF has them (llama.cpp's
NORM rope turns interleaved pairs, so the same reordering), kv_b split per head into k_b (transposed) and v_b, YaRN's
`mscale_all_dim` as a tenth of it (`yarn_log_multiplier`), the experts' gate and up fused (`ffn_gate_up_exps`). It
writes no position scaling of the queries (llama.cpp scales them only where `attention.temperature_scale` says)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from common.errors import CadenceError
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


_GGUF_KEYS = frozenset(
    "attention.q_lora_rank attention.kv_lora_rank attention.key_length_mla attention.value_length_mla "
    "leading_dense_block_count expert_shared_count expert_weights_scale expert_gating_func expert_group_count "
    "expert_group_used_count attention.temperature_scale attention.temperature_length".split()
)
_SOFTMAX = 1  # llama.cpp's expert_gating_func for softmax scores (its DeepSeek-2 default where the key is absent)


def _gguf(key, a: dict) -> dict:
    """The fields of llama.cpp's mistral4 keys (formats/source.py reads the heads' sizes from the `_mla` keys)."""
    if not key("attention.q_lora_rank", 0):
        raise CadenceError("a mistral4 GGUF without attention.q_lora_rank (one query projection) is not run yet")
    if int(key("expert_gating_func", _SOFTMAX)) != _SOFTMAX:
        raise CadenceError(f"expert_gating_func {key('expert_gating_func')} (experts not chosen by softmax) is not run")
    if int(key("expert_group_used_count", 1)) < int(key("expert_group_count", 1)):
        raise CadenceError("expert_group_used_count below expert_group_count (group-limited routing) is not run yet")
    out, scaling, scale = {}, a.get("rope_scaling"), a["head_dim"] ** -0.5
    if scaling is not None and scaling.kind == "yarn" and scaling.mscale_all_dim:
        m = float(np.float32(scaling.mscale_all_dim) / np.float32(0.1))  # llama.cpp: written as a tenth of it
        out["rope_scaling"] = dataclasses.replace(scaling, mscale_all_dim=m)
        scale *= _mscale(scaling.factor, m) ** 2
    if beta := float(key("attention.temperature_scale", 0.0) or 0.0):
        if not key("attention.temperature_length", 0):
            raise CadenceError("attention.temperature_scale without attention.temperature_length (its floor scale)")
        out |= {"attn_temp_beta": beta, "attn_temp_scale": float(key("attention.temperature_length"))}
    return {
        **out,
        "n_kv_heads": a["n_heads"],  # (the GGUF says 1: MLA as MQA)
        "attn_scale": scale,
        "mla_kv_rank": int(key("attention.kv_lora_rank")),
        "mla_q_rank": int(key("attention.q_lora_rank")),
        "routed_scale": float(key("expert_weights_scale", 1.0)),
        "norm_topk_eps": 1e-20,
        "shared_gated": False,
    }


def _join(name: str, parts: list, args) -> np.ndarray:
    """kv_b's rows from llama.cpp's k_b [heads, rank, nope] and v_b [heads, v, rank]: each head's keys, its values."""
    if not name.endswith(".attn_kv_b"):
        return np.concatenate(parts)
    k, v = parts
    return np.concatenate([k.transpose(0, 2, 1), v], axis=1).reshape(-1, k.shape[1])


MISTRAL4 = Family(
    "mistral4",
    hf_types=("mistral4",),
    gguf_archs=("mistral4",),
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
    gguf_keys=_GGUF_KEYS,
    gguf_fields=_gguf,
    gguf_names={
        "attn_q_a": ("attn_q_a",),
        "attn_q_a_norm": ("attn_q_a_norm",),
        "attn_q": ("attn_q_b",),
        "attn_kv_a": ("attn_kv_a_mqa",),
        "attn_kv_a_norm": ("attn_kv_a_norm",),
        "attn_kv_b": ("attn_k_b", "attn_v_b"),
    },
    gguf_split=_split,
    gguf_join=_join,
)
