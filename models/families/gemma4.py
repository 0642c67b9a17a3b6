"""Gemma 4 (text): Gemma 3's block of four norms (applied as plain `w`) with its GeGLU, plus what is new
(../shared/notes/model-families-2026.md):

- full-attention layers with heads of their own size and count (`global_head_dim`, and with `attention_k_eq_v`
  `num_global_key_value_heads`, or transformers' later `per_layer_config`), rotated by proportional RoPE (the first
  quarter of each head's pairs, at the whole head's frequencies); sliding layers keep `head_dim` and their base;
- q and k normed per head (plain w), each value head normed without a weight, the softmax unscaled (1.0);
- `attention_k_eq_v`: a full layer has no v_proj, its values are its raw keys (normed as values): read as a
  q/k/v matrix whose value rows are the key rows, one product as every layer;
- the last `num_kv_shared_layers` layers make no keys or values: each attends over those of the last earlier layer
  of its kind, and with `use_double_wide_mlp` their FFN is twice as wide;
- every layer's output times its `layer_scalar`;
- per-layer embeddings (E2B/E4B): a table of `ple_dim` per layer per token, read from disk row by row like the
  embeddings, plus a projection of the embeddings; after each FFN, x += norm(W_out(gelu(W_gate x) * ple_i));
- the 26B-A4B (`enable_moe_block`): GeGLU experts beside the dense MLP in every layer, with norms of their own and a
  router of their own (models/moe.py `beside_dense`), streamed through the expert buffer like any mixture's.

An encoder (`use_bidirectional_attention`) is refused in one sentence. llama.cpp's GGUF of it (arch `gemma4`) is
read by models/families/gemma4_gguf.py."""

from __future__ import annotations

import models.families.gemma4_gguf as gguf4
from models.families.base import FULL, SLIDING, Family, Unsupported, hf_rope, layer_kinds, windowed

_KEYS = frozenset(
    "final_logit_softcapping hidden_activation use_bidirectional_attention vocab_size_per_layer_input "
    "hidden_size_per_layer_input attention_k_eq_v num_kv_shared_layers enable_moe_block use_double_wide_mlp "
    "num_experts top_k_experts moe_intermediate_size global_head_dim num_global_key_value_heads "
    "per_layer_config".split()
)


def _full_heads(cfg: dict, a: dict, full: list[int]) -> tuple[int, int]:
    """(full layers' head size, their kv heads) in either spelling: `per_layer_config` (one override for every full
    layer, none for a sliding one), or `global_head_dim` beside `num_global_key_value_heads`."""
    per = cfg.get("per_layer_config")
    if per is None:
        kv = cfg.get("num_global_key_value_heads") if cfg.get("attention_k_eq_v", True) else None
        return int(cfg.get("global_head_dim") or 512), int(kv or a["n_kv_heads"])
    per = {int(k): v for k, v in per.items()}
    overrides = {tuple(sorted(per.get(i, {}).items())) for i in full}
    if set(per) - set(full) or len(overrides) != 1 or set(dict(*overrides)) - {"head_dim", "num_key_value_heads"}:
        raise Unsupported(f"per_layer_config {cfg['per_layer_config']} (cadence runs one override for all full layers)")
    o = dict(*overrides)
    return int(o.get("head_dim", a["head_dim"])), int(o.get("num_key_value_heads", a["n_kv_heads"]))


def _hf(cfg: dict, a: dict) -> dict:
    if cfg.get("use_bidirectional_attention"):
        raise Unsupported("use_bidirectional_attention: an encoder, not a causal decoder")
    if cfg["hidden_activation"] not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise Unsupported(f"hidden_activation {cfg['hidden_activation']!r} (cadence runs gelu_pytorch_tanh)")
    n = a["n_layers"]
    types = list(cfg.get("layer_types") or [SLIDING if (i + 1) % 6 else FULL for i in range(n)])
    types[-1] = FULL  # as transformers forces it
    sliding = layer_kinds({"layer_types": types}, n, lambda i: False)
    full = [i for i in range(n) if i not in sliding]
    head_dim, kv_heads = _full_heads(cfg, a, full)
    base, scaling, rope_dim = hf_rope(cfg, head_dim, FULL)
    local_base, local_scaling, local_dim = hf_rope(cfg, a["head_dim"], SLIDING)
    if local_scaling is not None or local_dim or rope_dim:
        raise Unsupported("rope scaling or a partial rotary on the sliding layers, or a partial one not proportional")
    window = windowed(cfg["sliding_window"], sliding, a["context_length"])
    if not window:
        raise Unsupported(f"a sliding window of {cfg['sliding_window']} covering the context (no sliding layers)")
    ple = int(cfg.get("hidden_size_per_layer_input") or 0)
    moe = {}
    if cfg.get("enable_moe_block"):  # the 26B-A4B: experts beside the dense MLP in every layer
        moe = {
            "n_experts": int(cfg["num_experts"]),
            "n_experts_used": int(cfg["top_k_experts"]),
            "expert_ffn_dim": int(cfg["moe_intermediate_size"]),
            "norm_topk": True,
            "experts_beside_dense": True,
        }
    return moe | {
        **window,
        "embed_scale": a["dim"] ** 0.5,
        "attn_scale": 1.0,
        "final_softcap": float(cfg.get("final_logit_softcapping") or 0.0),
        "rope_base": base,
        "rope_scaling": scaling,
        "rope_local_base": local_base,
        "full_head_dim": head_dim if head_dim != a["head_dim"] else 0,
        "full_kv_heads": kv_heads if kv_heads != a["n_kv_heads"] else 0,
        "kv_shared": int(cfg.get("num_kv_shared_layers") or 0),
        "wide_shared_ffn": bool(cfg.get("use_double_wide_mlp")),
        "ple_dim": ple,
        "ple_vocab": int(cfg.get("vocab_size_per_layer_input") or a["vocab_size"]) if ple else 0,
        "k_eq_v": bool(cfg.get("attention_k_eq_v")),
    }


def _layer_tensors(i: int, part: str, args) -> tuple[str, ...] | None:
    """A layer's own tensors where they differ from the family's: a sharing layer's queries alone; a full layer's
    keys twice where its values are its keys."""
    if part != "attn_qkv":
        return None
    if args.shares_kv(i):
        return ("self_attn.q_proj",)
    if args.k_eq_v and not args.sliding(i):
        return ("self_attn.q_proj", "self_attn.k_proj", "self_attn.k_proj")
    return None


def _skipped(name: str, args) -> bool:
    """Tensors a checkpoint may ship that no layer reads: a sharing layer's keys and values, as transformers skips."""
    parts = name.split(".")
    if "layers" not in parts:
        return False
    i = int(parts[parts.index("layers") + 1])
    return args.shares_kv(i) and parts[-2] in ("k_proj", "v_proj", "k_norm", "v_norm")


GEMMA4 = Family(
    "gemma4",
    hf_types=("gemma4_text",),
    gguf_archs=("gemma4",),
    block={"post_norm": True, "act": "gelu_tanh", "qk_norm": "head", "v_norm": True, "layer_scale": True},
    hf_defaults={
        "sliding_window": 512,
        "hidden_activation": "gelu_pytorch_tanh",
        "head_dim": 256,
        "vocab_size": 262_144,
        "rope_parameters": {
            SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
            FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
        },
    },
    hf_keys=_KEYS,
    hf_fields=_hf,
    hf_names={
        "attn_post_norm": ("post_attention_layernorm",),
        "ffn_norm": ("pre_feedforward_layernorm",),
        "ffn_post_norm": ("post_feedforward_layernorm",),
        "ple_gate": ("per_layer_input_gate",),
        "ple_out": ("per_layer_projection",),
        "ple_post_norm": ("post_per_layer_input_norm",),
        "layer_scale": ("layer_scalar",),
        "ffn_router": ("router.proj",),
        "ffn_router_scale": ("router.scale",),
        "ffn_expert_scale": ("router.per_expert_scale",),
        "ffn_post_norm_1": ("post_feedforward_layernorm_1",),
        "ffn_norm_2": ("pre_feedforward_layernorm_2",),
        "ffn_post_norm_2": ("post_feedforward_layernorm_2",),
    },
    hf_params=frozenset({"layer_scale", "ffn_router_scale", "ffn_expert_scale"}),
    hf_moe_prefix="",
    hf_globals={
        "embed_pl": "embed_tokens_per_layer.weight",
        "blk.0.ple_proj": "per_layer_model_projection.weight",
        "blk.0.ple_proj_norm": "per_layer_projection_norm.weight",
    },
    hf_layer_tensors=_layer_tensors,
    hf_skipped=_skipped,
    gguf_keys=gguf4.GGUF_KEYS,
    gguf_fields=gguf4.gguf_fields,
    gguf_names=gguf4.GGUF_NAMES,
    gguf_params=gguf4.GGUF_PARAMS,
    gguf_globals=gguf4.GGUF_GLOBALS,
    gguf_layer_tensors=gguf4.gguf_layer_tensors,
    gguf_layer_lists=gguf4.LAYER_LISTS,
    gguf_tensor_fields=gguf4.gguf_tensor_fields,
)
