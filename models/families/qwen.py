"""Qwen 2 and 3, dense (Qwen 3: q/k norms per head) and mixtures of experts (Qwen2-MoE: a shared expert with
its own sigmoid gate). Their sliding window, where a config turns it on, covers the layers from
`max_window_layers` up."""

from __future__ import annotations

from models.families.base import MOE_HF_KEYS, Family, layer_kinds, windowed

_MOE_KEYS = MOE_HF_KEYS | {"qkv_bias"}


def _sliding(cfg: dict, a: dict) -> dict:
    """A window only where `use_sliding_window` says so (transformers drops it otherwise), on the layers
    transformers 5's layer_types name, else (4) from max_window_layers up."""
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    lo = cfg.get("max_window_layers", 28)
    return windowed(window, layer_kinds(cfg, a["n_layers"], lambda i: i >= lo), a["context_length"])


def _qwen(name: str, hf_type: str, gguf: str, block: dict, keys=frozenset(), **kw) -> Family:
    return Family(
        name,
        hf_types=(hf_type,),
        gguf_archs=(gguf,),
        block=block,
        hf_defaults={"rope_theta": 10000.0},
        hf_keys=keys,
        hf_fields=_sliding,
        **kw,
    )


QWEN2 = _qwen("qwen2", "qwen2", "qwen2", {})
QWEN3 = _qwen("qwen3", "qwen3", "qwen3", {"qk_norm": "head"})
QWEN2_MOE = _qwen("qwen2_moe", "qwen2_moe", "qwen2moe", {}, _MOE_KEYS, shared_expert=True)
QWEN3_MOE = _qwen("qwen3_moe", "qwen3_moe", "qwen3moe", {"qk_norm": "head"}, _MOE_KEYS)
