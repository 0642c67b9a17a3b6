"""Granite 4.0-H (`granitemoehybrid`, dense: H-Micro, H-1B, H-350M): Mamba-2 layers (models/recurrent.py) among
attention layers that take no rotary embeddings (`position_embedding_type` null), Granite's four multipliers, and a
shared SwiGLU MLP (`shared_mlp.input_linear`: gate rows first). transformers 4 spelled the layer kinds `mamba` and
`attention`. The mixture-of-experts variants (H-Tiny, H-Small) are refused naming their experts. From llama.cpp's GGUF
(`granitehybrid`, bench/hf_gguf_granite.py writes one as its converter does): the Mamba layers are those with no kv
heads, the Mamba tensors read back into HF's layout (A_log from -exp(A_log))."""

from __future__ import annotations

import numpy as np

from common.errors import CadenceError
from models.families.base import MAMBA_PARAMS, Family, Unsupported, check_mamba_steps, hybrid_kinds, mamba_names
from models.families.llama import GRANITE_GGUF

_MULTIPLIERS = {
    "embedding_multiplier": "embed_scale",
    "attention_multiplier": "attn_scale",
    "residual_multiplier": "residual_scale",
    "logits_scaling": "logits_div",
}
_KEYS = frozenset(_MULTIPLIERS) | frozenset(
    "num_local_experts num_experts_per_tok output_router_logits router_aux_loss_coef shared_intermediate_size "
    "position_embedding_type layers_block_type mamba_n_heads mamba_n_groups mamba_d_state mamba_d_head mamba_d_conv "
    "mamba_expand mamba_chunk_size mamba_conv_bias mamba_proj_bias time_step_limit time_step_min time_step_max "
    "time_step_floor init_method".split()
)


def _hf(cfg: dict, a: dict) -> dict:
    if cfg.get("num_local_experts"):
        raise Unsupported(f"num_local_experts={cfg['num_local_experts']} (Granite 4.0-H's experts)")
    if cfg.get("mamba_proj_bias"):
        raise Unsupported("mamba_proj_bias: true (biases on the Mamba projections)")
    check_mamba_steps(cfg)
    n = a["n_layers"]
    cfg = {**cfg, "layer_types": cfg.get("layer_types") or cfg.get("layers_block_type")}
    types = hybrid_kinds(cfg, n, {"linear_attention", "full_attention"}, lambda i: "linear_attention")
    heads = int(cfg["mamba_n_heads"])
    inner = int(cfg.get("mamba_expand") or 2) * a["dim"]
    head_dim = cfg.get("mamba_d_head")
    attention = tuple(i for i, t in enumerate(types) if t == "full_attention")
    rope = cfg.get("position_embedding_type")
    if rope not in (None, "rope"):
        raise Unsupported(f"position_embedding_type={rope!r}")
    return {
        **{f: float(cfg[k]) for k, f in _MULTIPLIERS.items()},
        "ffn_dim": int(cfg["shared_intermediate_size"]),
        "ssm_layers": tuple(i for i, t in enumerate(types) if t == "linear_attention"),
        "ssm_heads": heads,
        "ssm_head_dim": inner // heads if head_dim in (None, "auto") else int(head_dim),
        "ssm_state": int(cfg["mamba_d_state"]),
        "ssm_groups": int(cfg.get("mamba_n_groups") or 1),
        "ssm_conv_bias": bool(cfg.get("mamba_conv_bias", True)),
        "conv_kernel": int(cfg.get("mamba_d_conv") or 4),
        "nope_layers": attention if rope is None else (),
    }


def _gguf(key, a: dict) -> dict:
    """llama.cpp's granitehybrid: Mamba layers have no kv heads; no rope unless `rope.scaling.finetuned` (Bamba)."""
    kv = key("attention.head_count_kv")
    if not isinstance(kv, list) or len(kv) != a["n_layers"]:
        raise CadenceError("a granitehybrid GGUF gives its kv heads a layer (0: a Mamba layer); this one does not")
    if key("expert_count"):
        raise CadenceError(f"expert_count={key('expert_count')} (Granite 4.0-H's experts) is not run yet")
    attention = tuple(i for i, n in enumerate(kv) if n)
    return {
        **{f: float(key(k, 1.0)) for k, f in GRANITE_GGUF.items()},
        "ffn_dim": int(key("expert_shared_feed_forward_length")),
        "ssm_layers": tuple(i for i, n in enumerate(kv) if not n),
        **mamba_gguf_fields(key),
        "nope_layers": () if key("rope.scaling.finetuned", False) else attention,
    }


# Where a Mamba-2 mixer's tensors are in a GGUF layer (llama.cpp's converter, Mamba2Model: granitehybrid, nemotron_h,
# falcon-h1); `ssm_a` and `ssm_d` are named without `.weight` (MAMBA_PARAMS)
MAMBA_GGUF = {
    "ssm_in": ("ssm_in",),
    "ssm_conv": ("ssm_conv1d",),
    "ssm_conv_b": ("ssm_conv1d.bias",),
    "ssm_dt": ("ssm_dt.bias",),
    "ssm_a": ("ssm_a",),
    "ssm_d": ("ssm_d",),
    "ssm_norm": ("ssm_norm",),
    "ssm_out": ("ssm_out",),
}


MAMBA_GGUF_KEYS = frozenset("ssm.conv_kernel ssm.state_size ssm.group_count ssm.inner_size ssm.time_step_rank".split())


def mamba_gguf_fields(key) -> dict:
    """A Mamba-2 layer's sizes as llama.cpp's Mamba2Model writes them (the heads as the time step's rank)."""
    heads, inner = int(key("ssm.time_step_rank")), int(key("ssm.inner_size"))
    return {
        "ssm_heads": heads,
        "ssm_head_dim": inner // heads,
        "ssm_state": int(key("ssm.state_size")),
        "ssm_groups": int(key("ssm.group_count")),
        "ssm_conv_bias": True,
        "conv_kernel": int(key("ssm.conv_kernel")),
    }


def mamba_gguf_split(name: str, src: str, w: np.ndarray, args) -> np.ndarray:
    """A Mamba tensor of the GGUF in HF's layout: A_log from -exp(A_log), D and the gated norm's weight flat."""
    part = src.split(".")[2] if src.startswith("blk.") else ""
    if part in ("ssm_a", "ssm_d", "ssm_norm"):
        w = w.reshape(-1)
    return np.log(-w) if part == "ssm_a" else w


GRANITE_HYBRID = Family(
    "granitehybrid",
    hf_types=("granitemoehybrid",),
    gguf_archs=("granitehybrid",),
    gguf_keys=frozenset(GRANITE_GGUF)
    | MAMBA_GGUF_KEYS
    | {"expert_shared_feed_forward_length", "rope.scaling.finetuned", "vocab_size"},
    gguf_fields=_gguf,
    gguf_names=MAMBA_GGUF,
    gguf_split=mamba_gguf_split,
    gguf_params=MAMBA_PARAMS,
    gguf_permuted=True,
    hf_defaults={**{k: 1.0 for k in _MULTIPLIERS}, "rope_theta": 10000.0, "mamba_expand": 2, "mamba_conv_bias": True},
    hf_keys=_KEYS,
    hf_fields=_hf,
    hf_names={
        "ffn_gate_up": ("shared_mlp.input_linear",),
        "ffn_down": ("shared_mlp.output_linear",),
        **mamba_names("mamba."),
    },
    hf_params=MAMBA_PARAMS,
)
