"""Gemma 4 (text) in a GGUF as llama.cpp's converter writes it (conversion/gemma.py `Gemma4Model`, arch `gemma4`;
bench/hf_gguf_gemma4.py writes one the same way). Its keys: the full layers' head size as `attention.key_length` and
the sliding layers' as `key_length_swa`; the kv heads and the FFN widths one a layer where layers differ (the full
layers' kv heads of their own, the KV-sharing layers' double-wide FFN); the sliding layers as a list of flags; the
KV-sharing layers' count and the per-layer embeddings' width. The full layers' proportional rotary is a `rope_freqs`
tensor that divides the frequencies of the pairs that rotate by 1 and those of the others by 1e30 (llama.cpp rotates
the whole head). Norms are stored as they are applied (w, not Gemma 3's 1 + w). What the keys do not say, the
tensors a file holds do: a full layer with keys and no `attn_v` takes its keys as its values (`attention_k_eq_v`),
a KV-sharing layer has queries alone, and the per-layer embeddings' table has a row per token. A file with no
`final_logit_softcapping` has its logits capped at 30, as llama.cpp runs it (its Gemma 4 default; every released
Gemma 4 writes 30)."""

from __future__ import annotations

from common.errors import CadenceError
from models.families.base import gguf_pattern, windowed
from models.rope_scaling import RopeScaling

GGUF_KEYS = frozenset(
    "attention.sliding_window attention.sliding_window_pattern final_logit_softcapping rope.freq_base_swa "
    "attention.shared_kv_layers embedding_length_per_layer_input attention.key_length_swa attention.value_length_swa "
    "rope.dimension_count_swa".split()
)
LLAMA_CPP_CAP = 30.0  # the final logits' cap llama.cpp gives a Gemma 4 GGUF that writes none

GGUF_NAMES = {
    "ple_gate": ("inp_gate",),
    "ple_out": ("proj",),
    "ple_post_norm": ("post_norm",),
    "layer_scale": ("layer_output_scale",),
    "ffn_router_scale": ("ffn_gate_inp.scale",),
    "ffn_expert_scale": ("ffn_down_exps.scale",),
    "ffn_post_norm_1": ("post_ffw_norm_1",),
    "ffn_norm_2": ("pre_ffw_norm_2",),
    "ffn_post_norm_2": ("post_ffw_norm_2",),
}
GGUF_PARAMS = frozenset({"ffn_router_scale", "ffn_expert_scale"})  # `.scale`s, not `.weight`s
GGUF_GLOBALS = {
    "embed_pl": "per_layer_token_embd.weight",
    "blk.0.ple_proj": "per_layer_model_proj.weight",
    "blk.0.ple_proj_norm": "per_layer_proj_norm.weight",
}
LAYER_LISTS = frozenset({"attention.head_count_kv", "feed_forward_length"})  # one a layer, read here


def _one_a_layer(key, name: str, n: int) -> list[int]:
    x = key(name)
    return [int(v) for v in x] if isinstance(x, list) else [int(x)] * n


def _kv_heads(key, n: int, sliding: tuple[int, ...]) -> tuple[int, int]:
    """(the sliding layers' kv heads, the full layers')."""
    kv = _one_a_layer(key, "attention.head_count_kv", n)
    swa, full = {kv[i] for i in sliding}, {kv[i] for i in range(n) if i not in sliding}
    if len(swa) != 1 or len(full) > 1:
        raise CadenceError(f"kv heads {kv} differ among the layers of one kind; cadence runs one count a kind")
    return swa.pop(), full.pop() if full else kv[sliding[0]]


def _ffn(key, n: int, shared: int) -> tuple[int, bool]:
    """(the FFN's width, whether the KV-sharing layers' is twice that)."""
    ff = _one_a_layer(key, "feed_forward_length", n)
    if ff == ff[:1] * n:
        return ff[0], False
    if shared and ff == ff[:1] * (n - shared) + [2 * ff[0]] * shared:
        return ff[0], True
    raise CadenceError(
        f"FFN widths {ff} are neither one width nor one with the last {shared} (KV-sharing) layers' twice as wide"
    )


def _proportional(scaling, head_dim: int) -> RopeScaling:
    """The full layers' rotary from `rope_freqs`: 1 on the first pairs (they rotate), 1e30 on the rest."""
    d = scaling.divisors if scaling is not None and scaling.kind == "divisors" else ()
    turn = sum(x == 1.0 for x in d)
    if len(d) != head_dim // 2 or not all(x == 1.0 for x in d[:turn]) or not all(x > 1e29 for x in d[turn:]):
        raise CadenceError(
            "a Gemma 4 GGUF's rope_freqs is 1 on the first pairs of a full layer's head and 1e30 on the others "
            "(its proportional rotary); this file has none or another"
        )
    return RopeScaling("proportional", factor=1.0, proportion=turn / len(d))


def gguf_fields(key, a: dict) -> dict:
    """The fields of the keys (`a`: the common ones, `head_dim` the full layers' as `attention.key_length` says)."""
    n, full_head_dim = a["n_layers"], a["head_dim"]
    sliding = gguf_pattern(key, n, 6)
    head_dim = int(key("attention.key_length_swa", full_head_dim))
    if int(key("attention.value_length_swa", head_dim)) != head_dim:
        raise CadenceError("values narrower or wider than keys on the sliding layers are not supported")
    if (int(key("rope.dimension_count_swa", head_dim)), int(key("rope.dimension_count", full_head_dim))) != (
        head_dim,
        full_head_dim,
    ):
        raise CadenceError("a rotary of part of a head by rope.dimension_count(_swa) is not a Gemma 4 cadence knows")
    window = windowed(key("attention.sliding_window", 0), sliding, a["context_length"])
    if not window:
        raise CadenceError("a Gemma 4 GGUF whose window covers the context (no sliding layers) is not supported")
    shared = int(key("attention.shared_kv_layers", 0))
    ffn_dim, wide = _ffn(key, n, shared)
    kv, full_kv = _kv_heads(key, n, sliding)
    moe = {"norm_topk": True, "experts_beside_dense": True, "dense_layers": ()} if key("expert_count", 0) else {}
    return moe | {
        **window,
        "head_dim": head_dim,
        "full_head_dim": full_head_dim if full_head_dim != head_dim else 0,
        "n_kv_heads": kv,
        "full_kv_heads": full_kv if full_kv != kv else 0,
        "ffn_dim": ffn_dim,
        "wide_shared_ffn": wide,
        "kv_shared": shared,
        "ple_dim": int(key("embedding_length_per_layer_input", 0)),
        "embed_scale": a["dim"] ** 0.5,
        "attn_scale": 1.0,
        "final_softcap": float(key("final_logit_softcapping", LLAMA_CPP_CAP)),
        "rope_local_base": float(key("rope.freq_base_swa", 10000.0)),
        "rope_scaling": _proportional(a.get("rope_scaling"), full_head_dim),
    }


def gguf_tensor_fields(tensors: dict) -> dict:
    """What the tensors a file holds say: a layer with keys and no values takes its keys as values (the converter
    writes no `attn_v` where the checkpoint has no v_proj); the per-layer embeddings' rows."""
    k_eq_v = any(t.endswith(".attn_k.weight") and t.replace(".attn_k.", ".attn_v.") not in tensors for t in tensors)
    table = tensors.get("per_layer_token_embd.weight")
    return {"k_eq_v": k_eq_v} | ({"ple_vocab": int(table.shape[0])} if table is not None else {})


def gguf_layer_tensors(i: int, part: str, args) -> tuple[str, ...] | None:
    """As gemma4.py's `_layer_tensors`, in llama.cpp's names: a sharing layer's queries alone; a full layer's keys
    twice where its values are its keys."""
    if part != "attn_qkv":
        return None
    if args.shares_kv(i):
        return ("attn_q",)
    if args.k_eq_v and not args.sliding(i):
        return ("attn_q", "attn_k", "attn_k")
    return None
