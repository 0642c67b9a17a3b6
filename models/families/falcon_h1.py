"""Falcon-H1 (TII): every layer runs a Mamba-2 mixer (models/recurrent.py) and an attention side by side on the
same normed input, their outputs added (`ModelArgs.parallel_mixers`); then a SwiGLU MLP. Its muP multipliers
(on the mixers' inputs and outputs, the keys, the Mamba projection's five parts, the MLP's gate and output) are
folded into the weights as they are read, as llama.cpp's converter does; the embeddings' and the head's are
`embed_scale` and `logits_div`. The Mamba output is y * silu(z), or a grouped RMSNorm before or after the gate
(`mamba_rms_norm`, `mamba_norm_before_gate`). From llama.cpp's GGUF (`falcon-h1`, bench/hf_gguf_falcon_h1.py writes
one as its converter does): every multiplier is in the tensors already, the embeddings' and the head's too (no key
holds one), so none is applied again; the Mamba output's norm is there where its tensor is, after the gate (llama.cpp
runs no other); the pre-FFN norm is `ffn_norm` without `.weight`, the Mamba tensors read back into HF's layout."""

from __future__ import annotations

import numpy as np

from models.families.base import MAMBA_PARAMS, Family, Unsupported, check_mamba_steps, mamba_names
from models.families.granite_hybrid import MAMBA_GGUF, MAMBA_GGUF_KEYS, mamba_gguf_fields, mamba_gguf_split

_KEYS = frozenset(
    "num_logits_to_keep mamba_d_ssm mamba_n_heads mamba_d_head mamba_n_groups mamba_d_state mamba_d_conv "
    "mamba_expand mamba_chunk_size mamba_conv_bias mamba_proj_bias mamba_norm_before_gate mamba_rms_norm "
    "time_step_limit time_step_min time_step_max time_step_floor projectors_bias lm_head_multiplier "
    "embedding_multiplier mlp_multipliers key_multiplier attention_out_multiplier attention_in_multiplier "
    "ssm_multipliers ssm_in_multiplier ssm_out_multiplier layers_block_type".split()
)


def _inner(cfg: dict, dim: int) -> int:
    return int(cfg.get("mamba_d_ssm") or int(cfg.get("mamba_expand") or 2) * dim)


def _hf(cfg: dict, a: dict) -> dict:
    if cfg.get("mamba_proj_bias") or cfg.get("projectors_bias") or cfg.get("attention_bias"):
        raise Unsupported("biases on the projections (mamba_proj_bias, projectors_bias or attention_bias)")
    if cfg.get("hidden_act", "silu") != "silu":
        raise Unsupported(f"hidden_act {cfg['hidden_act']!r}")
    check_mamba_steps(cfg)
    inner, heads = _inner(cfg, a["dim"]), int(cfg["mamba_n_heads"])
    head_dim = cfg.get("mamba_d_head")
    norm = "none" if not cfg.get("mamba_rms_norm") else "before" if cfg.get("mamba_norm_before_gate") else "gated"
    return {
        "embed_scale": float(cfg.get("embedding_multiplier", 1.0)),
        "logits_div": 1.0 / float(cfg.get("lm_head_multiplier", 1.0)),
        "ssm_layers": tuple(range(a["n_layers"])),
        "parallel_mixers": True,
        "ssm_heads": heads,
        "ssm_head_dim": inner // heads if head_dim in (None, "auto") else int(head_dim),
        "ssm_state": int(cfg["mamba_d_state"]),
        "ssm_groups": int(cfg.get("mamba_n_groups") or 1),
        "ssm_conv_bias": bool(cfg.get("mamba_conv_bias", True)),
        "ssm_norm": norm,
        "conv_kernel": int(cfg.get("mamba_d_conv") or 4),
    }


def _scales(cfg: dict, args) -> dict:
    """Each multiplier as a scale on the rows of the weight it follows (a scale on a linear's input is one on every
    row of its output)."""
    a, f = args, lambda k: float(cfg.get(k, 1.0))  # noqa: E731
    gate_m, down_m = (float(m) for m in cfg.get("mlp_multipliers") or (1.0, 1.0))
    z, x, b, c, dt = (float(m) for m in cfg.get("ssm_multipliers") or (1.0,) * 5)
    gn = a.ssm_groups * a.ssm_state
    ssm_in = np.concatenate([np.full(n, m) for n, m in ((a.ssm_inner, z), (a.ssm_inner, x), (gn, b), (gn, c))])
    qkv = np.concatenate([np.ones(a.q_dim), np.full(a.kv_dim, f("key_multiplier")), np.ones(a.kv_dim)])
    return {
        "ssm_in": np.concatenate([ssm_in, np.full(a.ssm_heads, dt)]) * f("ssm_in_multiplier"),
        "ssm_out": np.full(a.dim, f("ssm_out_multiplier")),
        "attn_qkv": qkv * f("attention_in_multiplier"),
        "attn_out": np.full(a.dim, f("attention_out_multiplier")),
        "ffn_gate_up": np.concatenate([np.full(a.ffn_dim, gate_m), np.ones(a.ffn_dim)]),
        "ffn_down": np.full(a.dim, down_m),
    }


def _gguf(key, a: dict) -> dict:
    """llama.cpp's falcon-h1: a Mamba mixer and an attention in every layer."""
    return {
        "ssm_layers": tuple(range(a["n_layers"])),
        "parallel_mixers": True,
        **mamba_gguf_fields(key),
        "ssm_norm": "gated",
    }


FALCON_H1 = Family(
    "falcon_h1",
    hf_types=("falcon_h1",),
    gguf_archs=("falcon-h1",),
    gguf_keys=MAMBA_GGUF_KEYS,
    gguf_fields=_gguf,
    # llama.cpp's Mamba-2 layer: a gated norm where the file has one (Falcon-H1's alone may lack it)
    gguf_tensor_fields=lambda tensors: {} if "blk.0.ssm_norm.weight" in tensors else {"ssm_norm": "none"},
    gguf_names={**MAMBA_GGUF, "ffn_norm": ("ffn_norm",)},
    gguf_split=mamba_gguf_split,
    gguf_params=MAMBA_PARAMS | {"ffn_norm"},
    hf_defaults={"rope_theta": 10000.0, "mamba_d_ssm": 1024, "mamba_n_heads": 128, "mamba_d_state": 256},
    hf_keys=_KEYS,
    hf_fields=_hf,
    hf_names={
        "out_norm": ("final_layernorm",),
        "ffn_norm": ("pre_ff_layernorm",),
        "ffn_gate_up": ("feed_forward.gate_proj", "feed_forward.up_proj"),
        "ffn_down": ("feed_forward.down_proj",),
        **mamba_names("mamba."),
    },
    hf_params=MAMBA_PARAMS,
    hf_scales=_scales,
)
