"""What a family of models is, in the few things that tell it apart: its names (HF `model_type`, llama.cpp
architecture), the `ModelArgs` fields its config sets (models/args.py: the block is one for every family),
and where its tensors are in an HF directory and in a GGUF file. Everything else is shared here: the config
fields every family has, rotary scaling in both spellings, which layers slide, and the tensor transforms
(llama.cpp's q/k row order, a partial rotary's lanes, Gemma's `1 + w` norms).

A field, key or tensor a family does not know is never ignored: formats/source.py and source_hf.py refuse
it in one sentence that names it (a model that loads and computes wrong is the worst outcome).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from common.errors import CadenceError
from models.rope_scaling import RopeScaling

# Canonical part -> its tensors in an HF layer (`model.layers.{i}.` + name + `.weight`), concatenated in order.
LLAMA_HF = {
    "attn_norm": ("input_layernorm",),
    "attn_qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "attn_out": ("self_attn.o_proj",),
    "ffn_norm": ("post_attention_layernorm",),
    "ffn_gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "ffn_down": ("mlp.down_proj",),
    "attn_q_norm": ("self_attn.q_norm",),
    "attn_k_norm": ("self_attn.k_norm",),
}
# ... and in a GGUF layer (`blk.{i}.` + name + `.weight`), as llama.cpp's converter names them
LLAMA_GGUF = {
    "attn_norm": ("attn_norm",),
    "attn_qkv": ("attn_q", "attn_k", "attn_v"),
    "attn_out": ("attn_output",),
    "ffn_norm": ("ffn_norm",),
    "ffn_gate_up": ("ffn_gate", "ffn_up"),
    "ffn_down": ("ffn_down",),
    "attn_q_norm": ("attn_q_norm",),
    "attn_k_norm": ("attn_k_norm",),
    "attn_post_norm": ("post_attention_norm",),
    "ffn_post_norm": ("post_ffw_norm",),
}

# HF config keys that change nothing cadence computes: metadata, training settings, generation defaults
COMMON_HF_KEYS = frozenset(
    "architectures model_type torch_dtype dtype transformers_version _name_or_path bos_token_id eos_token_id "
    "pad_token_id sep_token_id decoder_start_token_id tie_word_embeddings vocab_size hidden_size intermediate_size "
    "num_hidden_layers num_attention_heads num_key_value_heads head_dim max_position_embeddings rms_norm_eps "
    "rope_theta rope_scaling rope_parameters partial_rotary_factor hidden_act initializer_range use_cache "
    "attention_dropout attention_bias mlp_bias pretraining_tp layer_types sliding_window output_attentions "
    "output_hidden_states return_dict use_return_dict torchscript use_bfloat16 is_encoder_decoder is_decoder "
    "add_cross_attention cross_attention_hidden_size tie_encoder_decoder chunk_size_feed_forward id2label label2id "
    "problem_type tokenizer_class prefix task_specific_params finetuning_task pruned_heads tf_legacy_loss "
    "max_length min_length do_sample early_stopping num_beams num_beam_groups diversity_penalty temperature top_k "
    "top_p typical_p repetition_penalty length_penalty no_repeat_ngram_size encoder_no_repeat_ngram_size "
    "bad_words_ids num_return_sequences output_scores return_dict_in_generate forced_bos_token_id "
    "forced_eos_token_id remove_invalid_values exponential_decay_length_penalty suppress_tokens "
    "begin_suppress_tokens embd_pdrop resid_pdrop hidden_dropout attention_probs_dropout_prob unsloth_version "
    "unsloth_fixed auto_map cache_implementation use_sliding_window max_window_layers".split()
)
# GGUF keys under the architecture's prefix that every family reads, or that change nothing
COMMON_GGUF_KEYS = frozenset(
    "context_length embedding_length block_count feed_forward_length attention.head_count attention.head_count_kv "
    "attention.layer_norm_rms_epsilon attention.key_length attention.value_length rope.freq_base "
    "rope.dimension_count vocab_size rope.scaling.type rope.scaling.factor rope.scaling.original_context_length "
    "rope.scaling.finetuned rope.scaling.attn_factor rope.scaling.yarn_beta_fast rope.scaling.yarn_beta_slow "
    "rope.scaling.yarn_log_multiplier".split()
)
# what the mixtures of experts' configs say of their experts (formats/source_hf.py reads and checks each)
MOE_HF_KEYS = frozenset(
    "num_experts num_local_experts num_experts_per_tok moe_intermediate_size shared_expert_intermediate_size "
    "norm_topk_prob decoder_sparse_step mlp_only_layers router_aux_loss_coef output_router_logits "
    "router_jitter_noise".split()
)
SLIDING, FULL = "sliding_attention", "full_attention"


class Unsupported(Exception):
    """A config field whose value sets a computation cadence does not run (the sources say which file)."""


@dataclass(frozen=True)
class Family:
    name: str  # ModelArgs.arch
    hf_types: tuple[str, ...]
    gguf_archs: tuple[str, ...]
    block: dict = field(default_factory=dict)  # ModelArgs fields every model of the family has
    hf_defaults: dict = field(default_factory=dict)  # what transformers' config class assumes for an absent key
    hf_keys: frozenset = frozenset()  # config keys the family reads beyond COMMON_HF_KEYS
    hf_fields: Callable[[dict, dict], dict] = lambda cfg, args: {}  # (config, common fields) -> family fields
    hf_names: dict = field(default_factory=dict)  # overrides of LLAMA_HF
    hf_norm_shift: float = 0.0  # Gemma: norms stored as w, applied as 1 + w
    gguf_keys: frozenset = frozenset()
    gguf_fields: Callable[[Callable, dict], dict] = lambda key, args: {}  # (key(name, default), common) -> fields
    gguf_names: dict = field(default_factory=dict)  # overrides of LLAMA_GGUF
    gguf_permuted: bool = False  # llama.cpp interleaved the rotary pairs of q/k rows (its NORM rope)
    interleaved: bool = False  # the model itself rotates interleaved pairs (GLM-4), in both files
    hf_params: frozenset = frozenset()  # parts whose HF tensors are parameters (`dt_bias`), not `.weight`s
    # (canonical name, HF tensor name, its array) -> the part of it the canonical tensor takes (Qwen 3.5's q_proj:
    # each head's queries, or its gates)
    hf_split: Callable[[str, str, np.ndarray, object], np.ndarray] = lambda name, src, w, args: w
    hf_config: Callable[[dict], dict] = lambda cfg: cfg  # a config in the common keys' spelling (Nemotron-H's)
    # (config, ModelArgs) -> {part: a scale per output row}: multipliers folded into the weights as they are read
    # (Falcon-H1's muP multipliers, as llama.cpp's converter folds them)
    hf_scales: Callable[[dict, object], dict] = lambda cfg, args: {}
    hf_moe_prefix: str = "mlp"  # where a layer's router and experts are (`feed_forward` in LFM2-MoE)
    shared_expert: bool = False  # a shared expert beside the routed ones, gated by sigmoid (Qwen2-MoE, Qwen 3.5)
    # experts fused [experts, in, out] as x W, gate and up "interleaved" by column (gpt-oss) or in "halves" (Llama 4)
    experts_xw: str = ""
    hf_globals: dict = field(default_factory=dict)  # canonical name -> a tensor of the model's, not of a layer
    # (layer, part, ModelArgs) -> that layer's tensors of the part where they differ from `hf_names` (else None)
    hf_layer_tensors: Callable[[int, str, object], tuple | None] = lambda i, part, args: None
    hf_skipped: Callable[[str, object], bool] = lambda name, args: False  # a tensor no layer reads (Gemma 4's shared)
    # (canonical name, GGUF tensor name, its array, ModelArgs) -> the part of it the canonical tensor takes, in HF's
    # layout (Qwen 3.5's: a head's queries or gates, value heads grouped again by key head, A_log from -exp(A_log))
    gguf_split: Callable[[str, str, np.ndarray, object], np.ndarray] = lambda name, src, w, args: w
    gguf_params: frozenset = frozenset()  # parts whose GGUF tensors are named without `.weight` (`ssm_a`)
    gguf_globals: dict = field(default_factory=dict)  # canonical name -> a GGUF tensor of the model's, not of a layer
    # (layer, part, ModelArgs) -> that layer's GGUF tensors of the part where they differ from `gguf_names` (else None)
    gguf_layer_tensors: Callable[[int, str, object], tuple | None] = lambda i, part, args: None
    # keys one a layer whose values differ that the family reads itself (Gemma 4's kv heads and FFN widths): the
    # common fields take the first layer's
    gguf_layer_lists: frozenset = frozenset()
    # (the GGUF's tensors by name) -> the fields a file says by the tensors it holds (GLM-4.5's optional q/k norms)
    gguf_tensor_fields: Callable[[dict], dict] = lambda tensors: {}
    # (canonical name, its GGUF tensors as gguf_split gave them, ModelArgs) -> the canonical tensor: their rows one
    # after another, or joined otherwise (Mistral 4's kv_b from llama.cpp's k_b and v_b, head by head)
    gguf_join: Callable[[str, list, object], np.ndarray] = lambda name, parts, args: np.concatenate(parts)

    def hf_tensors(self, part: str) -> tuple[str, ...]:
        return {**LLAMA_HF, **self.hf_names}[part]

    def gguf_tensors(self, part: str) -> tuple[str, ...]:
        return {**LLAMA_GGUF, **self.gguf_names}[part]


def hf_rope(cfg: dict, head_dim: int, kind: str = FULL) -> tuple[float, RopeScaling | None, int]:
    """(base, scaling, rotated dims) of a kind of layer from an HF config: transformers 5's `rope_parameters`
    (flat, or one per layer kind), else 4's `rope_theta` beside `rope_scaling`."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if isinstance(rope.get(kind), dict):
        rope = rope[kind]
    elif kind == SLIDING and cfg.get("rope_local_base_freq"):  # transformers 4's Gemma 3: unscaled, its own base
        rope = {"rope_theta": cfg["rope_local_base_freq"]}
    elif any(isinstance(v, dict) for v in rope.values()):
        rope = next(v for v in rope.values() if isinstance(v, dict))
    base = float(rope.get("rope_theta") or cfg.get("rope_theta") or 10000.0)
    partial = float(rope.get("partial_rotary_factor") or cfg.get("partial_rotary_factor") or 1.0)
    rope_dim = int(head_dim * partial) if partial < 1.0 else 0
    kind_name = rope.get("rope_type", rope.get("type", "default"))
    if kind_name == "default":
        return base, None, rope_dim
    if kind_name == "proportional":  # Gemma 4: the head's first pairs rotate in place (no lanes moved)
        return base, RopeScaling("proportional", factor=float(rope.get("factor") or 1.0), proportion=partial), 0
    orig = rope.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
    orig = int(orig or cfg["max_position_embeddings"])
    factor = rope.get("factor")
    if kind_name in ("longrope", "yarn") and factor is None:
        factor = cfg["max_position_embeddings"] / orig
    scaling = RopeScaling(
        kind_name,
        factor=float(factor if factor is not None else 1.0),
        original_context=cfg["max_position_embeddings"] if kind_name == "dynamic" else orig,
        low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
        high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
        beta_fast=float(rope.get("beta_fast") or 32),
        beta_slow=float(rope.get("beta_slow") or 1),
        truncate=bool(rope.get("truncate", True)),
        mscale=float(rope.get("mscale") or 0),
        mscale_all_dim=float(rope.get("mscale_all_dim") or 0),
        attention_factor=float(rope.get("attention_factor") or 0),
        short_factor=tuple(rope.get("short_factor") or ()),
        long_factor=tuple(rope.get("long_factor") or ()),
    )
    return base, scaling, rope_dim


def layer_kinds(cfg: dict, n_layers: int, default: Callable[[int], bool]) -> tuple[int, ...]:
    """The sliding layers: transformers 5's `layer_types`, else the family's rule for transformers 4's keys."""
    types = cfg.get("layer_types")
    if types is None:
        return tuple(i for i in range(n_layers) if default(i))
    odd = sorted(set(types) - {SLIDING, FULL})
    if odd or len(types) != n_layers:
        raise CadenceError(
            f"layer_types {odd or len(types)} is not {n_layers} of {FULL!r} and {SLIDING!r}; cadence runs those only"
        )
    return tuple(i for i, t in enumerate(types) if t == SLIDING)


def hybrid_kinds(cfg: dict, n_layers: int, kinds: set[str], default: Callable[[int], str]) -> list[str]:
    """A hybrid's layer kinds: the config's `layer_types` (transformers 4's `mamba` / `attention` read as 5's
    `linear_attention` / `full_attention`), else the family's rule; a list of another length or kind is refused."""
    legacy = {"mamba": "linear_attention", "attention": "full_attention"}
    types = [legacy.get(t, t) for t in cfg.get("layer_types") or []] or [default(i) for i in range(n_layers)]
    if len(types) != n_layers or set(types) - kinds:
        raise ValueError(f"layer_types {types} is not {n_layers} of {sorted(kinds)}")
    return types


def mamba_names(prefix: str) -> dict:
    """Where a Mamba-2 mixer's tensors are in an HF layer, under `prefix` (Granite: `mamba.`, Nemotron-H: `mixer.`)."""
    parts = {"ssm_in": "in_proj", "ssm_conv": "conv1d", "ssm_conv_b": "conv1d.bias", "ssm_dt": "dt_bias"}
    parts |= {"ssm_a": "A_log", "ssm_d": "D", "ssm_norm": "norm", "ssm_out": "out_proj"}
    return {part: (prefix + name,) for part, name in parts.items()}


MAMBA_PARAMS = frozenset({"ssm_conv_b", "ssm_dt", "ssm_a", "ssm_d"})  # parameters of their own, not `.weight`s


def check_mamba_steps(cfg: dict) -> None:
    """Mamba-2's step dt unclamped (`time_step_limit` (0, inf), the released models'): a clamp is refused. A float
    JSON cannot hold is written by transformers 5 as {"__float__": "Infinity"}."""
    number = lambda x: float(x["__float__"]) if isinstance(x, dict) else float(x)  # noqa: E731
    limit = [number(x) for x in cfg.get("time_step_limit") or (0.0, math.inf)]
    if limit[0] != 0.0 or not math.isinf(limit[1]):
        raise Unsupported(f"time_step_limit={limit} (a clamped Mamba step)")


def windowed(window, sliding: tuple[int, ...], context: int) -> dict:
    """The ModelArgs fields of a sliding window: none where no layer slides or the window covers the context."""
    if not window or not sliding or int(window) >= context:
        return {}
    return {"sliding_window": int(window), "sliding_layers": sliding}


def gguf_pattern(key: Callable, n_layers: int, every: int) -> tuple[int, ...]:
    """The sliding layers of a GGUF (llama.cpp's `load_swa_pattern`): a per-layer list of flags as the converters
    write it, else one full layer in `every`, the last of each."""
    pattern = key("attention.sliding_window_pattern", every)
    if isinstance(pattern, list):
        return tuple(i for i, s in enumerate(pattern) if s)
    return tuple(i for i in range(n_layers) if pattern == 0 or i % pattern < pattern - 1)


def gguf_rope(key: Callable, tensors: dict, read: Callable[[str], np.ndarray]) -> dict:
    """The rope fields of a GGUF: its scaling keys, Llama 3's `rope_freqs` divisors, LongRoPE's factor tensors."""
    kind = key("rope.scaling.type", None)
    out = {}
    if "rope_freqs.weight" in tensors:
        if kind not in (None, "none"):
            raise CadenceError(f"rope scaling '{kind}' beside a rope_freqs tensor is not a layout cadence knows")
        out["rope_scaling"] = RopeScaling("divisors", divisors=tuple(read("rope_freqs.weight").tolist()))
    elif "rope_factors_long.weight" in tensors:
        out["rope_scaling"] = RopeScaling(
            "longrope",
            original_context=int(key("rope.scaling.original_context_length", 4096)),
            attention_factor=float(key("rope.scaling.attn_factor", 0) or 0),
            short_factor=tuple(read("rope_factors_short.weight").tolist()),
            long_factor=tuple(read("rope_factors_long.weight").tolist()),
        )
    elif kind == "linear":
        out["rope_scaling"] = RopeScaling("linear", factor=float(key("rope.scaling.factor")))
    elif kind == "yarn":
        log_mul = float(key("rope.scaling.yarn_log_multiplier", 0) or 0)  # llama.cpp: mscale_all_dim
        out["rope_scaling"] = RopeScaling(
            "yarn",
            factor=float(key("rope.scaling.factor")),
            original_context=int(key("rope.scaling.original_context_length")),
            beta_fast=float(key("rope.scaling.yarn_beta_fast", 32.0)),
            beta_slow=float(key("rope.scaling.yarn_beta_slow", 1.0)),
            attention_factor=float(key("rope.scaling.attn_factor", 0) or 0),
            mscale=1.0 if log_mul else 0.0,
            mscale_all_dim=log_mul,
        )
    elif kind not in (None, "none"):
        raise CadenceError(f"rope scaling '{kind}' is not supported; cadence runs linear, yarn and llama3 (rope_freqs)")
    return out


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (its NORM rope keeps each rotary pair's rows side by side)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def deinterleave(w: np.ndarray, n_head: int, head_dim: int, lanes: int) -> np.ndarray:
    """A model that rotates interleaved pairs (2i, 2i + 1) of a head's first `lanes` lanes (GLM-4) in the
    rotate-half order of those lanes (pairs (i, i + lanes / 2)); the other lanes stay."""
    heads = w.reshape(n_head, head_dim, *w.shape[1:]).copy()
    rot = heads[:, :lanes].reshape(n_head * lanes, *w.shape[1:])
    heads[:, :lanes] = unpermute(rot, n_head).reshape(n_head, lanes, *w.shape[1:])
    return heads.reshape(w.shape)


def permute_partial(w: np.ndarray, n_head: int, head_dim: int, rope_dim: int) -> np.ndarray:
    """A partial rotary's q/k rows rearranged for a whole-head rotate-half: each head's lanes
    [rotated first half | unrotated first half | rotated second half | unrotated second half], so that the
    pairs (i, i + rope_dim / 2) land at (i, i + head_dim / 2); the unrotated lanes get frequency 0
    (models/rope.py). q.k is the same sum over the same lanes in another order."""
    r, p = rope_dim // 2, (head_dim - rope_dim) // 2
    lanes = np.arange(head_dim)
    order = np.concatenate([lanes[:r], lanes[rope_dim : rope_dim + p], lanes[r:rope_dim], lanes[rope_dim + p :]])
    return w.reshape(n_head, head_dim, *w.shape[1:])[:, order].reshape(w.shape)
