"""An HF model directory written as a GGUF file the way llama.cpp's converter writes it (random-weight models of each
family for benchmarks, bench/synth_family.py; the tiny ones of tests/models/families.py).

`write_gguf_like_llama_cpp(hf_folder, out, qtype)` follows convert_hf_to_gguf.py (conversion/llama.py, gemma.py,
phi.py, granite.py, olmo.py, qwen.py, base.py) key for key and tensor for tensor, in its order: the same
`general.architecture`, hparam keys, tensor names, shapes and bytes (checked against the real converter's output for
every family and variant). What each family's converter does to the tensors:

- llama, mistral (both `llama` in GGUF), granite: q/k rows permuted for llama.cpp's non-NEOX rope (LlamaModel.permute);
  a Llama 3.x `rope_type: llama3` becomes a `rope_freqs.weight` tensor of per-dimension divisors and no rope key.
- gemma2, gemma3: every `*norm.weight` stored +1 (the (1 + w) folded in); lm_head dropped (tied).
- phi3: `qkv_proj` stays fused as `attn_qkv`, `gate_up_proj` stays fused as `ffn_up` (gate rows first); longrope's
  factors become `rope_factors_long/short.weight` plus `rope.scaling.attn_factor`.
- olmo2, gemma: post-norms (`post_attention_norm`, `post_ffw_norm`); qwen2, qwen3, olmo2, gemma, phi3: no permutation.
- smollm3, ministral3 (`mistral3`): LlamaModel's permutation; ministral3's YaRN keys, `yarn_log_multiplier` and
  `attention.temperature_scale`. olmo3 (`olmo2`) and exaone4: a window and per-layer sliding flags. glm4: its
  four norms, gate_up kept fused as `ffn_up`, `rope.dimension_count` half a head. seed_oss: its pre-FFN norm
  as `post_attention_norm`. (conversion/llama.py, olmo.py, exaone.py, glm.py, mistral3.py)

Only the byte-level BPE tokenizer path (`tokenizer.ggml.model` = gpt2) is reproduced, which is what the tiny folders
carry; the pre-tokenizer is named from the tokenizer.json's split regex (the real converter hashes the token ids of a
check text, which no 320-token vocabulary matches). Needs transformers."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import torch

from bench import (
    hf_gguf_falcon_h1,
    hf_gguf_gemma4,
    hf_gguf_glm4moe,
    hf_gguf_gptoss,
    hf_gguf_granite,
    hf_gguf_lfm2,
    hf_gguf_llama4,
    hf_gguf_mistral4,
    hf_gguf_nemotron,
    hf_gguf_qwen35,
)
from bench.hf_gguf_vocab import vocab_gpt2

QWEN2_SPLIT = (  # Qwen2's split regex (llama.cpp's pre-tokenizer "qwen2"), as its tokenizer.json has it
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)

GGUF_ARCH = {
    "llama": "llama",
    "mistral": "llama",  # MistralForCausalLM converts as LlamaModel
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "phi3": "phi3",
    "granite": "granite",
    "olmo2": "olmo2",
    "qwen3": "qwen3",
    "qwen2": "qwen2",
    "smollm3": "smollm3",
    "olmo3": "olmo2",  # Olmo3Model is Olmo2Model with a window
    "seed_oss": "seed_oss",
    "exaone4": "exaone4",
    "glm4": "glm4",
    "ministral3": "mistral3",
}
# families whose converter is written in a module of its own: ARCHS (model_type -> llama.cpp arch), tensors(h, named)
# and params(w, h, text_params), text_params(hh=h) writing TextModel's keys from the config hh; after_vocab(w, h), where
# a module has one, writes what its converter's set_vocab adds after the vocabulary
WRITERS = (
    hf_gguf_qwen35,
    hf_gguf_lfm2,
    hf_gguf_granite,
    hf_gguf_gptoss,
    hf_gguf_mistral4,
    hf_gguf_gemma4,
    hf_gguf_llama4,
    hf_gguf_glm4moe,
    hf_gguf_nemotron,
    hf_gguf_falcon_h1,
)
OWN_WRITERS = {mt: m for m in WRITERS for mt in m.ARCHS}
GGUF_ARCH.update({mt: arch for m in WRITERS for mt, arch in m.ARCHS.items()})
PERMUTE_QK = (
    "llama",
    "mistral",
    "granite",
    "smollm3",
    "ministral3",
)  # LlamaModel and its subclasses: undo_permute = True
GEMMA = ("gemma2", "gemma3_text")
FILE_TYPES = {"F32": 0, "F16": 1, "Q8_0": 7, "BF16": 32}  # gguf.LlamaFileType of each --outtype
PRE_TOKENIZERS = {QWEN2_SPLIT: "qwen2"}

# HF module name -> GGUF tensor name (gguf-py's tensor_mapping.py for these architectures)
_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.qkv_proj": "attn_qkv",  # phi3
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",  # the pre-FFN norm of llama-like blocks ...
    "pre_feedforward_layernorm": "ffn_norm",  # gemma
    "post_feedforward_layernorm": "post_ffw_norm",  # gemma, olmo2
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up",  # phi3: gate and up fused, gate first, one tensor of 2 * n_ff rows
    "mlp.down_proj": "ffn_down",
    "post_self_attn_layernorm": "post_attention_norm",  # glm4
    "post_mlp_layernorm": "post_ffw_norm",  # glm4
}
# ... but the attention's post-norm in these (Seed-OSS: llama.cpp's name for its pre-FFN norm)
_POST_ATTN = ("gemma2", "gemma3_text", "olmo2", "olmo3", "exaone4", "seed_oss")


def gguf_tensor_name(model_type: str, hf_name: str) -> str:
    module, _, suffix = hf_name.rpartition(".")
    if module in _TOP:
        return f"{_TOP[module]}.{suffix}"
    _, _, bid, rest = module.split(".", 3)  # model.layers.{bid}.{rest}
    name = _LAYER[rest]
    if rest == "post_attention_layernorm" and model_type in _POST_ATTN:
        name = "post_attention_norm"
    return f"blk.{bid}.{name}.{suffix}"


def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """LlamaModel.permute: each head's rows from (pairs of halves) to interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _safetensors(folder: Path):
    """(name, tensor) in the order the file's header lists them, which is the order the converter reads them."""
    from safetensors import safe_open

    for path in sorted(folder.glob("model*.safetensors")):
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            names = [k for k in json.loads(f.read(n)) if k != "__metadata__"]
        with safe_open(str(path), "pt") as st:
            for name in names:
                yield name, st.get_tensor(name)


def _model_tensors(h: dict, folder: Path):
    mt, n_head, n_kv = h["model_type"], h["num_attention_heads"], h["num_key_value_heads"]
    for name, x in _safetensors(folder):
        if mt in GEMMA and name == "lm_head.weight":
            continue  # Gemma*Model.filter_tensors
        x = x.to(torch.float32) if x.dtype not in (torch.float16, torch.float32) else x
        if mt in PERMUTE_QK and name.endswith(("q_proj.weight", "q_proj.bias")):
            x = _permute(x, n_head)
        if mt in PERMUTE_QK and name.endswith(("k_proj.weight", "k_proj.bias")):
            x = _permute(x, n_kv)
        if mt == "gemma3_text" and name.endswith("embed_tokens.weight"):  # out-of-vocabulary rows cut
            tj = json.loads((folder / "tokenizer.json").read_text())
            x = x[: len(tj["model"]["vocab"]) + len(tj["added_tokens"])]
        if mt in GEMMA and name.endswith("norm.weight"):
            x = x + 1
        yield gguf_tensor_name(mt, name), x


def _rope_parameters(h: dict) -> dict:
    """TextModel.__init__: rope_parameters (or rope_scaling), with the global values mirrored into it."""
    rope = json.loads(json.dumps(h.get("rope_parameters", h.get("rope_scaling")) or {}))

    def find(*keys):
        return next((h[k] for k in keys if k in h), None)

    if "full_attention" not in rope and "sliding_attention" not in rope:
        local = find(
            "local_rope_theta", "rope_local_theta", "rope_theta_local", "swa_rope_theta", "rope_local_base_freq"
        )
        if local is not None:
            rope["sliding_attention"] = {"rope_theta": local}
        mirrored = {
            "rope_theta": find("global_rope_theta", "rope_global_theta", "rope_theta_global", "rope_theta"),
            "rope_type": rope.get("type"),
            "partial_rotary_factor": find("partial_rotary_factor", "rope_pct", "rope_percent"),
            "original_max_position_embeddings": find("original_max_position_embeddings"),
        }
        rope.update({k: v for k, v in mirrored.items() if k not in rope and v is not None})
    return rope


def _extra_tensors(w, h: dict, rope: dict):
    """generate_extra_tensors: Llama 3's rope_freqs (LlamaModel), Phi-3's longrope factors (Phi3MiniModel)."""
    rp = rope.get("full_attention", rope)
    if h["model_type"] in PERMUTE_QK and rp.get("rope_type", "").lower() == "llama3":
        yield "rope_freqs.weight", hf_gguf_llama4.llama3_divisors(h, rp, rp.get("rope_theta", 10000.0))
    if h["model_type"] == "phi3" and rope.get("long_factor"):
        max_pos, orig = h["max_position_embeddings"], rope["original_max_position_embeddings"]
        scale, kind = max_pos / orig, rope.get("rope_type", "").lower()
        if kind in ("su", "longrope"):
            attn_factor = math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1.0 else 1.0
        else:
            raise NotImplementedError(f"phi3 rope type {kind!r}")
        w.add_rope_scaling_attn_factors(attn_factor)
        yield "rope_factors_long.weight", torch.tensor(rope["long_factor"], dtype=torch.float32)
        yield "rope_factors_short.weight", torch.tensor(rope["short_factor"], dtype=torch.float32)


# the tensors ModelBase.prepare_tensors keeps in F32 whatever the output type (those of the families written here):
# llama.cpp's CPU convolutions read F32 taps only
ALWAYS_F32 = ("ffn_gate_inp", "ffn_gate_inp_shexp", "ssm_conv1d", "conv", "pos_embd", "token_types")


def _put(w, name: str, x: torch.Tensor, qtype: str) -> None:
    """ModelBase.prepare_tensors' type choice: 1-D tensors, norms and biases stay F32, the rest become `qtype`."""
    import gguf

    data = x.numpy()
    q = gguf.GGMLQuantizationType[qtype]
    kept = name.rsplit(".", 1)[0].split(".")[-1] in ALWAYS_F32  # routers and convolutions, whatever --outtype
    if data.ndim <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight") or kept:
        q = gguf.GGMLQuantizationType.F32
    try:
        out = gguf.quants.quantize(data, q)
    except gguf.QuantError:
        q = gguf.GGMLQuantizationType.F16
        out = gguf.quants.quantize(data, q)
    w.add_tensor(name, out, raw_dtype=q)


def _text_model_params(w, h: dict, rope: dict, ftype: int) -> None:
    """TextModel.set_gguf_parameters, for the keys these families have."""
    import gguf

    w.add_block_count(h["num_hidden_layers"])
    w.add_context_length(h["max_position_embeddings"])
    w.add_embedding_length(h["hidden_size"])
    w.add_feed_forward_length(h["intermediate_size"])
    w.add_head_count(h["num_attention_heads"])
    w.add_head_count_kv(h["num_key_value_heads"])
    rp = rope.get("full_attention", rope)
    kind = rp.get("rope_type")
    if kind == "linear" and rp.get("factor") is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rp["factor"])
    elif kind in ("su", "longrope"):
        w.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE)
    elif kind == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rp["factor"])
        w.add_rope_scaling_orig_ctx_len(rp["original_max_position_embeddings"])
        for key, add in (
            ("beta_fast", w.add_rope_scaling_yarn_beta_fast),
            ("beta_slow", w.add_rope_scaling_yarn_beta_slow),
        ):
            if rp.get(key) is not None:
                add(rp[key])
    elif kind not in (None, "default", "llama3", "proportional"):  # these two: a rope_freqs tensor, no key
        raise NotImplementedError(f"rope type {kind!r} is not reproduced here")
    if (theta := rp.get("rope_theta")) is not None:
        w.add_rope_freq_base(theta)
    if (swa_theta := rope.get("sliding_attention", {}).get("rope_theta")) is not None:
        w.add_rope_freq_base_swa(swa_theta)
    w.add_layer_norm_rms_eps(h["rms_norm_eps"])
    if h.get("head_dim") is not None:
        w.add_key_length(h["head_dim"])
        w.add_value_length(h["head_dim"])
    w.add_file_type(ftype)


def _gemma2_params(w, h: dict, ftype: int) -> None:
    """Gemma2Model.set_gguf_parameters: its own list, no rope key at all (llama.cpp's default base is 10000)."""
    w.add_context_length(h["max_position_embeddings"])
    w.add_embedding_length(h["hidden_size"])
    w.add_block_count(h["num_hidden_layers"])
    w.add_feed_forward_length(h["intermediate_size"])
    w.add_head_count(h["num_attention_heads"])
    w.add_head_count_kv(h.get("num_key_value_heads", h["num_attention_heads"]))
    w.add_layer_norm_rms_eps(h["rms_norm_eps"])
    w.add_key_length(h["head_dim"])
    w.add_value_length(h["head_dim"])
    w.add_file_type(ftype)
    w.add_attn_logit_softcapping(h["attn_logit_softcapping"])
    w.add_final_logit_softcapping(h["final_logit_softcapping"])
    w.add_sliding_window(h["sliding_window"])


def _phi3_params(w, h: dict, rope: dict, ftype: int) -> None:
    """Phi3MiniModel.set_gguf_parameters: rope dims from hidden / heads x partial_rotary_factor; always a window."""
    n_embd, n_head = h["hidden_size"], h["num_attention_heads"]
    w.add_context_length(h["max_position_embeddings"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(h["intermediate_size"])
    w.add_block_count(h["num_hidden_layers"])
    w.add_head_count(n_head)
    w.add_head_count_kv(h["num_key_value_heads"])
    w.add_layer_norm_rms_eps(h["rms_norm_eps"])
    w.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * n_embd) // n_head)
    w.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])
    w.add_file_type(ftype)
    w.add_sliding_window(h.get("sliding_window") or 0)  # 0: no window (how Phi-4 is told apart)


def _hparams(w, h: dict, rope: dict, ftype: int) -> None:
    mt = h["model_type"]
    if mt in OWN_WRITERS:  # bench/hf_gguf_*.py
        return OWN_WRITERS[mt].params(w, h, lambda hh=h: _text_model_params(w, hh, rope, ftype))
    if mt == "gemma2":
        return _gemma2_params(w, h, ftype)
    if mt == "phi3":
        return _phi3_params(w, h, rope, ftype)
    if mt == "granite":
        h = {k: v for k, v in h.items() if k != "head_dim"}  # GraniteModel: "Ignoring head_dim"
    _text_model_params(w, h, rope, ftype)
    if mt in PERMUTE_QK:  # LlamaModel
        w.add_vocab_size(h["vocab_size"])
        w.add_rope_dimension_count(h.get("head_dim") or h["hidden_size"] // h["num_attention_heads"])
    if mt == "granite":
        hf_gguf_granite.multipliers(w, h)
    if mt == "ministral3":  # Ministral3Model: the YaRN log multiplier and Llama 4's query scaling
        w.add_rope_scaling_yarn_log_mul(rope["mscale_all_dim"])
        w.add_attn_temperature_scale(rope["llama_4_scaling_beta"])
    if mt == "exaone4":
        w.add_vocab_size(h["vocab_size"])
    if mt in ("olmo3", "exaone4") and h.get("sliding_window") is not None:  # per-layer flags from layer_types
        w.add_sliding_window(h["sliding_window"])
        w.add_sliding_window_pattern([t == "sliding_attention" for t in h["layer_types"]])
    if mt == "glm4":
        head_dim = h.get("head_dim") or h["hidden_size"] // h["num_attention_heads"]
        w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 0.5)))
    if mt == "gemma3_text":  # Gemma3Model re-adds context, heads, eps, key/value length, freq_base: the same values
        assert h.get("attn_logit_softcapping") is None
        if h.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(h["final_logit_softcapping"])
        if h.get("sliding_window_pattern") != 1:
            w.add_sliding_window(h["sliding_window"])
    return None


def write_gguf_like_llama_cpp(hf_folder: Path, out: Path, qtype: str = "F32") -> Path:
    """The model in `hf_folder` (either config spelling) as llama.cpp's convert_hf_to_gguf.py writes it with
    `--outtype qtype.lower()` (F32, F16, BF16 or Q8_0): keys, tensors and their order as the converter has them."""
    import gguf
    from transformers import AutoConfig

    hf_folder, out = Path(hf_folder), Path(out)
    h = AutoConfig.from_pretrained(hf_folder).to_dict()  # ModelBase.load_hparams: what transformers reads
    mt = h["model_type"]
    if mt not in GGUF_ARCH:
        raise NotImplementedError(f"model_type {mt!r}: not one of {sorted(GGUF_ARCH)}")
    rope = _rope_parameters(h)
    w = gguf.GGUFWriter(str(out), GGUF_ARCH[mt])
    if mt in OWN_WRITERS:
        tensors = list(OWN_WRITERS[mt].tensors(h, _safetensors(hf_folder)))
    else:
        tensors = [*_extra_tensors(w, h, rope), *_model_tensors(h, hf_folder)]
    for name, x in tensors:
        _put(w, name, x, qtype)
    total = w.get_total_parameter_count()  # ModelBase.prepare_metadata
    meta = gguf.Metadata.load(None, hf_folder, None, total[0])
    meta.name = meta.name or hf_folder.name
    if meta.size_label is None and total[0] > 0:
        meta.size_label = gguf.size_label(*total)
    w.add_type(gguf.GGUFType.MODEL)
    meta.set_gguf_meta_model(w)
    _hparams(w, h, rope, FILE_TYPES[qtype])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    vocab_gpt2(w, hf_folder, h, PRE_TOKENIZERS)
    if hasattr(OWN_WRITERS.get(mt), "after_vocab"):
        OWN_WRITERS[mt].after_vocab(w, h)
    if mt == "gemma2":
        w.add_add_space_prefix(False)  # Gemma2Model.set_vocab (after its SentencePiece vocab, here the BPE one)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
