"""Nemotron-H (NVIDIA): a layer is one part, after its own pre-norm: a Mamba-2 mixer (models/recurrent.py), an
attention (no rotary: NoPE), or a non-gated MLP (relu(x W_up)^2 W_down), in the order `layers_block_type` gives
(transformers 4: `hybrid_override_pattern`, M / * / -). Its tensors sit under `backbone.` (`embeddings`, `norm_f`,
`layers.N.norm`, `layers.N.mixer.*`). Mixture-of-experts layers (E, Nemotron-3) are refused naming them. From
llama.cpp's GGUF (`nemotron_h`, bench/hf_gguf_nemotron.py writes one as its converter does): a layer's kind is in
its kv heads and FFN width a layer (both 0: Mamba; kv heads: attention; a width: MLP), every layer's norm is
`attn_norm`, the attention's q/k rows permuted as Llama's (llama.cpp runs them without rotary), the Mamba tensors
read back into HF's layout (A_log from -exp(A_log))."""

from __future__ import annotations

from common.errors import CadenceError
from models.families.base import MAMBA_PARAMS, Family, Unsupported, check_mamba_steps, mamba_names
from models.families.granite_hybrid import MAMBA_GGUF, MAMBA_GGUF_KEYS, mamba_gguf_fields, mamba_gguf_split

_PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
_LEGACY = {"mamba": "linear_attention", "attention": "full_attention"}
_KEYS = frozenset(
    "layers_block_type hybrid_override_pattern layer_norm_epsilon num_logits_to_keep mlp_hidden_act use_mamba_kernels "
    "ssm_state_size mamba_num_heads mamba_head_dim mamba_hidden_act n_groups conv_kernel expand time_step_min "
    "time_step_max time_step_limit time_step_floor use_conv_bias chunk_size mamba_proj_bias mamba_ssm_cache_dtype "
    "n_routed_experts output_router_logits n_shared_experts moe_intermediate_size moe_shared_expert_intermediate_size "
    "moe_latent_size moe_shared_expert_overlap num_experts_per_tok routed_scaling_factor n_group topk_group "
    "norm_topk_prob num_nextn_predict_layers mtp_layers_block_type use_bias rescale_prenorm_residual residual_in_fp32 "
    "hidden_dropout".split()
)


def _types(cfg: dict) -> list[str]:
    types = cfg.get("layers_block_type") or cfg.get("layer_types")
    if types is None and cfg.get("hybrid_override_pattern"):
        types = [_PATTERN[c] for c in cfg["hybrid_override_pattern"]]
    return [_LEGACY.get(t, t) for t in types or []]


def _config(cfg: dict) -> dict:
    """The common keys in Nemotron-H's spelling: its layer count is its pattern's, its norms' epsilon its own."""
    return {**cfg, "num_hidden_layers": len(_types(cfg)), "rms_norm_eps": cfg.get("layer_norm_epsilon", 1e-5)}


def _hf(cfg: dict, a: dict) -> dict:
    types = _types(cfg)
    if "moe" in types:
        raise Unsupported("mixture-of-experts layers (layers_block_type 'moe': Nemotron-3's experts)")
    if set(types) - {"linear_attention", "full_attention", "mlp"}:
        raise ValueError(f"layers_block_type {types} holds a kind cadence does not know")
    if cfg.get("mlp_hidden_act", "relu2") != "relu2" or cfg.get("mamba_hidden_act", "silu") != "silu":
        raise Unsupported(f"activations {cfg.get('mlp_hidden_act')!r} / {cfg.get('mamba_hidden_act')!r}")
    if cfg.get("mamba_proj_bias") or cfg.get("use_bias"):
        raise Unsupported("biases on the Mamba projections")
    check_mamba_steps(cfg)
    if cfg.get("sliding_window"):
        raise Unsupported(f"sliding_window={cfg['sliding_window']}")
    kind = lambda k: tuple(i for i, t in enumerate(types) if t == k)  # noqa: E731
    return {
        "act": "relu2",
        "ssm_layers": kind("linear_attention"),
        "ssm_heads": int(cfg["mamba_num_heads"]),
        "ssm_head_dim": int(cfg["mamba_head_dim"]),
        "ssm_state": int(cfg["ssm_state_size"]),
        "ssm_groups": int(cfg.get("n_groups") or 1),
        "ssm_conv_bias": bool(cfg.get("use_conv_bias", True)),
        "conv_kernel": int(cfg.get("conv_kernel") or 4),
        "nope_layers": kind("full_attention"),
        "no_mixer_layers": kind("mlp"),
        "no_ffn_layers": kind("linear_attention") + kind("full_attention"),
    }


def _gguf(key, a: dict) -> dict:
    """llama.cpp's nemotron_h: a layer with neither kv heads nor an FFN width is a Mamba layer, one with kv heads but
    no FFN attends (without rotary), one with an FFN width is an MLP."""
    n, kv, ff = a["n_layers"], key("attention.head_count_kv"), key("feed_forward_length")
    if not (isinstance(kv, list) and isinstance(ff, list) and len(kv) == len(ff) == n):
        raise CadenceError(
            "a nemotron_h GGUF gives its kv heads and FFN widths a layer (its layer kinds); this one does not"
        )
    if key("expert_count"):
        raise CadenceError(f"expert_count={key('expert_count')} (Nemotron-3's experts) is not run yet")
    kind = lambda test: tuple(i for i in range(n) if test(int(kv[i]), int(ff[i])))  # noqa: E731
    return {
        "act": "relu2",
        "ssm_layers": kind(lambda h, f: not h and not f),
        **mamba_gguf_fields(key),
        "nope_layers": kind(lambda h, f: h and not f),
        "no_mixer_layers": kind(lambda h, f: f),
        "no_ffn_layers": kind(lambda h, f: not f),
    }


NEMOTRON_H = Family(
    "nemotron_h",
    hf_types=("nemotron_h",),
    gguf_archs=("nemotron_h",),
    # TextModel writes the config's layer_norm_epsilon beside the RMS one llama.cpp reads (the same value)
    gguf_keys=MAMBA_GGUF_KEYS | {"rope.scaling.finetuned", "attention.layer_norm_epsilon"},
    gguf_fields=_gguf,
    gguf_names={**MAMBA_GGUF, "ffn_norm": ("attn_norm",), "ffn_gate_up": ("ffn_up",)},
    gguf_split=mamba_gguf_split,
    gguf_params=MAMBA_PARAMS,
    gguf_permuted=True,
    hf_defaults={"rope_theta": 10000.0},
    hf_keys=_KEYS,
    hf_fields=_hf,
    hf_config=_config,
    hf_names={
        "embed": ("embeddings",),
        "out_norm": ("norm_f",),
        "attn_norm": ("norm",),
        "ffn_norm": ("norm",),
        "attn_qkv": ("mixer.q_proj", "mixer.k_proj", "mixer.v_proj"),
        "attn_out": ("mixer.o_proj",),
        "ffn_gate_up": ("mixer.up_proj",),
        "ffn_down": ("mixer.down_proj",),
        **mamba_names("mixer."),
    },
    hf_params=MAMBA_PARAMS,
)
