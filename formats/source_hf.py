"""An HF model directory as a model source: config.json (in the spellings transformers 4 and 5 write),
tokenizer.json and *.safetensors, read as float32 tensors under the weight store's canonical names
(formats/source.py). What a family changes (its config fields, its tensor names) is the family's
(models/families/); a config key or tensor no family reads is refused in one sentence."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from common.errors import CadenceError
from models.args import ModelArgs
from models.families import BY_HF
from models.families.base import COMMON_HF_KEYS, MOE_HF_KEYS, Family, Unsupported, hf_rope
from models.families.pending import pending
from common.files import read_json, read_text
from formats.source import NORMS, canonical_names, head_norm_layout, qkv_layout, refuse_unknown, sha256_file
from text.tokenizer import info_from_hf

# Keys transformers 4 and 5 spell differently when they save a config (the config classes' attribute maps:
# transformers 5 writes Qwen3-MoE's and Mixtral's expert count as num_local_experts, OLMoE's as num_experts;
# it moves rope_theta and rope_scaling into rope_parameters, and a sliding window into layer_types).
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
_IGNORED = ("rotary_emb.inv_freq",)  # buffers old checkpoints saved; computed from the config here


class HFSource:
    """An HF model directory: config.json, *.safetensors, tokenizer.json."""

    kind = "hf"

    def __init__(self, path: Path):
        from safetensors import safe_open

        self.path = Path(path)
        cfg_path, tj = self._needs("config.json"), self._needs("tokenizer.json")
        cfg = read_json(cfg_path, "re-download it")
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise CadenceError(f"{self.path} has no *.safetensors files")
        self.index: dict[str, Path] = {}
        for f in files:
            try:
                with safe_open(f, framework="pt") as sf:
                    for k in sf.keys():
                        self.index[k] = f
            except Exception as e:
                raise CadenceError(f"{f} is a damaged safetensors file ({e}); re-download it") from None
        cfg, self.wrapper = text_part(cfg)
        self.family = family_of(cfg, cfg_path)
        cfg = self.family.hf_config(cfg)
        # a multimodal checkpoint's text model: under model.language_model. (or llava's language_model.model.);
        # Nemotron-H's under backbone.
        self.prefix, self.head_name = "model.", "lm_head.weight"
        embed = self.family.hf_names.get("embed", ("embed_tokens",))[0]
        for prefix, head in (
            ("model.language_model.", "lm_head.weight"),
            ("language_model.model.", "language_model.lm_head.weight"),
            ("backbone.", "lm_head.weight"),
        ):
            if f"{prefix}{embed}.weight" in self.index:
                self.prefix, self.head_name = prefix, head
        self.args = hf_args(
            cfg,
            cfg_path,
            f"{self.prefix}layers.0.self_attn.q_proj.bias" in self.index
            or f"{self.prefix}layers.0.self_attn.qkv_proj.bias" in self.index,
            bool(cfg.get("tie_word_embeddings", False)) or self.head_name not in self.index,
        )
        self.scales = self.family.hf_scales({**self.family.hf_defaults, **cfg}, self.args)
        self.moe_prefix = "block_sparse_moe" if self.args.arch == "mixtral" else self.family.hf_moe_prefix
        self.moe_prefix += "." if self.moe_prefix else ""  # (Gemma 4's experts are the layer's own: no prefix)
        tc_path = self.path / "tokenizer_config.json"
        tc = read_json(tc_path, "re-download it") if tc_path.exists() else {}
        self.tokenizer = info_from_hf(read_text(tj, "re-download it"), tc, cfg, origin=str(tj))
        self._files = files + [cfg_path, tj]
        used = {n for _, c in canonical_names(self.args) for n in self._sources(c)} | {self.head_name}
        # a multi-token prediction head (Qwen 3.5, Qwen3-Next: mtp.*; GLM-4.5: layers past the last) is a draft of its
        # own, not run here
        n, mtp = self.args.n_layers, int(cfg.get("num_nextn_predict_layers") or cfg.get("num_mtp_layers") or 0)
        skip = ("mtp.", *(f"{self.prefix}layers.{i}." for i in range(n, n + mtp)))
        unknown = {k for k in self.index if k not in used and not k.endswith(_IGNORED) and not k.startswith(skip)}
        unknown = {k for k in unknown if not self.family.hf_skipped(k, self.args)}
        if self.wrapper:  # the vision (and audio) towers and their projectors: images are not run
            unknown = {k for k in unknown if k.startswith(self.prefix)}
        refuse_unknown("the tensor", unknown, str(self.path), self.family, "it is a variant cadence does not run")

    def _needs(self, name: str) -> Path:
        if not (self.path / name).exists():
            raise CadenceError(
                f"{self.path} has no {name}; an HF model directory needs config.json, *.safetensors and tokenizer.json"
            )
        return self.path / name

    def identity(self) -> str:
        h = hashlib.sha256()
        for f in self._files:
            h.update(f.name.encode())
            h.update(sha256_file(f).encode())
        return h.hexdigest()

    def _raw(self, key: str) -> np.ndarray:
        from safetensors import safe_open

        if key not in self.index:
            raise CadenceError(f"{self.path} has no tensor '{key}'; it is not a complete {self.args.arch} model")
        with safe_open(self.index[key], framework="pt") as sf:
            return sf.get_tensor(key).float().numpy()

    def _sources(self, name: str) -> list[str]:
        """The tensors of the directory a canonical tensor is made of (an expert: any of its spellings)."""
        if name in self.family.hf_globals:
            return [f"{self.prefix}{self.family.hf_globals[name]}"]
        if name in ("embed", "out_norm", "head"):
            return [
                {
                    "embed": f"{self.prefix}{self.family.hf_names.get('embed', ('embed_tokens',))[0]}.weight",
                    "out_norm": f"{self.prefix}{self.family.hf_names.get('out_norm', ('norm',))[0]}.weight",
                    "head": self.head_name,
                }[name]
            ]
        _, i, part = name.split(".", 2)
        p = f"{self.prefix}layers.{i}"
        if part.startswith("exp."):
            _, e, which = part.split(".")
            m = f"{p}.{self.moe_prefix}experts"
            base = "gate_up_proj" if which.startswith("gate_up") else "down_proj"
            if which.endswith("_bias"):
                return [f"{m}.{base}_bias"]
            single = {"gate_up": ("w1", "gate_proj", "w3", "up_proj"), "down": ("w2", "down_proj")}[which]
            fused = (base, f"{base}_blocks", f"{base}_scales")  # MXFP4: blocks of 32 4-bit values and their scales
            return [f"{m}.{e}.{n}.weight" for n in single] + [f"{m}.{n}" for n in fused]
        moe = {
            "ffn_router": [f"{self.moe_prefix}gate"],
            "ffn_shexp_gate": ["mlp.shared_expert_gate"],
            "ffn_shexp_gate_up": ["mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"],
            "ffn_shexp_down": ["mlp.shared_expert.down_proj"],
        }
        own = self.family.hf_layer_tensors(int(i), part.removesuffix("_bias"), self.args)
        if part == "attn_qkv_bias":
            return [f"{p}.{n}.bias" for n in own or self.family.hf_tensors("attn_qkv")]
        if part in self.family.hf_params:  # a parameter of its own, not a module's weight
            return [f"{p}.{n}" for n in self.family.hf_tensors(part)]
        names = own or self.family.hf_names.get(part) or moe.get(part) or self.family.hf_tensors(part)
        return [f"{p}.{n}.weight" for n in names]

    def _expert(self, i: str, e: int, which: str) -> np.ndarray:
        """One expert's matrix: from per-expert tensors (checkpoints as published), or from the fused
        [experts, ...] tensors transformers 5 may keep."""
        m = f"{self.prefix}layers.{i}.{self.moe_prefix}experts"
        names = {"gate": ("w1", "gate_proj"), "up": ("w3", "up_proj"), "down": ("w2", "down_proj")}[which]
        for n in names:
            if f"{m}.{e}.{n}.weight" in self.index:
                return self._raw(f"{m}.{e}.{n}.weight")
        if which == "down":
            return self._raw(f"{m}.down_proj")[e]
        gate, up = np.split(self._raw(f"{m}.gate_up_proj")[e], 2)
        return gate if which == "gate" else up

    def _slice(self, key: str, index: int):
        """Tensor `key`'s entry `index` along its first dimension, as stored (a read of that entry alone)."""
        from safetensors import safe_open

        if key not in self.index:
            raise CadenceError(f"{self.path} has no tensor '{key}'; it is not a complete {self.args.arch} model")
        with safe_open(self.index[key], framework="pt") as sf:
            return sf.get_slice(key)[index]

    def _expert_xw(self, i: str, e: int, which: str) -> np.ndarray:
        """One expert's part from gpt-oss's fused tensors: [experts, in, out] used as x W, gate and up interleaved by
        column (or MXFP4 blocks [experts, out, ...]), as [out, in] with the gate rows first."""
        m = f"{self.prefix}layers.{i}.{self.moe_prefix}experts"
        base = "gate_up_proj" if which.startswith("gate_up") else "down_proj"
        if which.endswith("_bias"):
            w = self._slice(f"{m}.{base}_bias", e).float().numpy()
        elif f"{m}.{base}_blocks" in self.index:
            w = mxfp4(self._slice(f"{m}.{base}_blocks", e), self._slice(f"{m}.{base}_scales", e))
        else:
            w = self._slice(f"{m}.{base}", e).float().numpy().T
        if base == "gate_up_proj" and self.family.experts_xw == "interleaved":
            return np.concatenate([w[0::2], w[1::2]])
        return np.ascontiguousarray(w)

    def get(self, name: str) -> np.ndarray:
        if name == "head" and self.args.tied_embeddings:
            name = "embed"
        if ".exp." in name and self.family.experts_xw:
            _, i, _, e, which = name.split(".")
            return self._expert_xw(i, int(e), which)
        if ".exp." in name:
            _, i, _, e, which = name.split(".")
            if which == "gate_up":
                return np.concatenate([self._expert(i, int(e), "gate"), self._expert(i, int(e), "up")])
            return self._expert(i, int(e), "down")
        srcs = self._sources(name)
        w = np.concatenate([self.family.hf_split(name, s, self._raw(s), self.args) for s in srcs])
        if (scale := self.scales.get(name.rsplit(".", 1)[-1])) is not None:
            w = w * scale.reshape(-1, *(1,) * (w.ndim - 1)).astype(np.float32)
        if name.endswith(("attn_qkv", "attn_qkv_bias")):
            return qkv_layout(w, self.args, interleaved=self.family.interleaved)
        if name.endswith(("conv_w", "gdn_conv", "ssm_conv")):  # transformers' depthwise Conv1d: [channels, 1, K]
            return w.reshape(w.shape[0], -1)
        if name.endswith(("attn_q_norm", "attn_k_norm")):
            w = head_norm_layout(w, self.args, self.family.interleaved)
        if name.endswith(NORMS) and self.family.hf_norm_shift:
            return w + np.float32(self.family.hf_norm_shift)  # Gemma: applied as 1 + w, as transformers does
        return w


FP4_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)


def mxfp4(blocks, scales) -> np.ndarray:
    """MXFP4 weights [out, groups, 16 bytes] (two 4-bit E2M1 values a byte, the low nibble first) and their
    scales [out, groups] (E8M0: 2^(s - 127)) as float32 [out, groups * 32], as transformers dequantizes them."""
    b = blocks.numpy().astype(np.uint8)
    out = np.empty((*b.shape[:-1], b.shape[-1] * 2), dtype=np.float32)
    out[..., 0::2], out[..., 1::2] = FP4_VALUES[b & 0x0F], FP4_VALUES[b >> 4]
    out = np.ldexp(out, scales.numpy().astype(np.int32)[..., None] - 127)
    return out.reshape(b.shape[0], -1)


def text_part(cfg: dict) -> tuple[dict, str]:
    """(the config of the text model, the multimodal wrapper's model_type or ''): a checkpoint with a `text_config`
    (Mistral 3, Gemma 4, Qwen 3.5) is run as its text model, as llama.cpp converts it; the root's tie flag counts."""
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        return cfg, ""
    tied = bool(cfg.get("tie_word_embeddings")) or bool(text.get("tie_word_embeddings"))
    return {**text, "tie_word_embeddings": tied}, str(cfg.get("model_type"))


def family_of(cfg: dict, path: Path) -> Family:
    mt = cfg.get("model_type")
    if mt not in BY_HF:
        raise CadenceError(
            f"{path}: model_type '{mt}' is not supported{pending('hf', mt)}; cadence runs {', '.join(BY_HF)} models"
        )
    return BY_HF[mt]


def hf_args(cfg: dict, path: Path, qkv_bias: bool, tied: bool) -> ModelArgs:
    """ModelArgs from an HF config.json at `path` (its `model_type` one of the families'), as transformers 4
    or 5 writes it; a field missing, of the wrong type, or not one the family reads ends in one sentence
    naming the file."""
    fam = family_of(cfg, path)
    cfg = {**fam.hf_defaults, **fam.hf_config(cfg)}
    refuse_unknown(
        "the config field", set(cfg) - COMMON_HF_KEYS - fam.hf_keys, str(path), fam, "remove it if it is 0 or false"
    )
    try:
        return _hf_args(cfg, fam, path, qkv_bias, tied)
    except KeyError as e:
        raise CadenceError(f"{path} has no {e} field, which a {fam.name} config needs; re-download it") from None
    except Unsupported as e:
        raise CadenceError(f"{path}: {e} is not something cadence runs in a {fam.name} model") from None
    except (TypeError, ValueError, AttributeError) as e:
        raise CadenceError(
            f"{path} has a field of the wrong kind for a {fam.name} config ({e}); re-download it"
        ) from None


def _hf_args(cfg: dict, fam: Family, path: Path, qkv_bias: bool, tied: bool) -> ModelArgs:
    if cfg.get("mlp_bias"):
        raise Unsupported("mlp_bias: true (biases in the FFN)")
    if cfg.get("clip_qkv") is not None:
        raise Unsupported(f"clip_qkv={cfg['clip_qkv']}")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    if act != {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh"}[fam.block.get("act", "silu")]:
        raise Unsupported(f"hidden_act {act!r}")
    n_heads, dim = int(cfg["num_attention_heads"]), int(cfg["hidden_size"])
    common = dict(
        vocab_size=int(cfg["vocab_size"]),
        dim=dim,
        n_layers=int(cfg["num_hidden_layers"]),
        n_heads=n_heads,
        n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
        ffn_dim=int(cfg["intermediate_size"]),
        norm_eps=float(cfg.get("rms_norm_eps") or 1e-6),
        context_length=int(cfg.get("max_position_embeddings") or 2048),
        head_dim=int(cfg.get("head_dim") or dim // n_heads),
    )
    base, scaling, rope_dim = hf_rope(cfg, common["head_dim"])
    common |= dict(rope_base=base, rope_scaling=scaling, rope_dim=rope_dim)
    fields = {**fam.block, **common, **_moe(cfg, fam, path), **fam.hf_fields(cfg, common)}
    return ModelArgs(arch=fam.name, qkv_bias=qkv_bias, tied_embeddings=tied, **fields)


def _moe(cfg: dict, fam: Family, path: Path) -> dict:
    if not MOE_HF_KEYS <= fam.hf_keys:  # not a mixture-of-experts family (Granite 4.0-H reads its own keys)
        return {}
    step, only = int(cfg.get("decoder_sparse_step") or 1), set(cfg.get("mlp_only_layers") or ())
    dense = tuple(i for i in range(int(cfg["num_hidden_layers"])) if i in only or (i + 1) % step)
    n_experts = next((cfg[k] for k in EXPERT_COUNT_KEYS if cfg.get(k)), 0)
    if not n_experts:
        raise CadenceError(
            f"{path} gives no expert count ({' or '.join(EXPERT_COUNT_KEYS)}), which a {fam.name} model needs; "
            "re-download it"
        )
    return dict(
        n_experts=int(n_experts),
        n_experts_used=int(cfg.get("num_experts_per_tok") or 0),
        expert_ffn_dim=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
        shared_ffn_dim=int(cfg.get("shared_expert_intermediate_size") or 0) if fam.shared_expert else 0,
        norm_topk=True if fam.name == "mixtral" else bool(cfg.get("norm_topk_prob", False)),
        dense_layers=dense,  # dense FFNs among the experts' layers (mlp_only_layers, decoder_sparse_step)
    )
