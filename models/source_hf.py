"""An HF model directory as a model source: config.json (in the spellings transformers 4 and 5 write),
tokenizer.json and *.safetensors, read as float32 tensors under the weight store's canonical names
(models/source.py)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from common.errors import CadenceError
from models.config import ModelArgs
from models.files import read_json, read_text
from models.source import HF_ARCHS, NORM_TOPK, sha256_file
from models.tokenizer import info_from_hf


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
        self.args = hf_args(
            cfg,
            cfg_path,
            "model.layers.0.self_attn.q_proj.bias" in self.index,
            bool(cfg.get("tie_word_embeddings", False)) or "lm_head.weight" not in self.index,
        )
        self.moe_prefix = "block_sparse_moe" if self.args.arch == "mixtral" else "mlp"
        tc_path = self.path / "tokenizer_config.json"
        tc = read_json(tc_path, "re-download it") if tc_path.exists() else {}
        self.tokenizer = info_from_hf(read_text(tj, "re-download it"), tc, cfg, origin=str(tj))
        self._files = files + [cfg_path, tj]

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

    def _expert(self, i: str, e: int, which: str) -> np.ndarray:
        """One expert's matrix: from per-expert tensors (checkpoints as published), or from the fused
        [experts, ...] tensors transformers 5 may keep."""
        m = f"model.layers.{i}.{self.moe_prefix}.experts"
        names = {"gate": ("w1", "gate_proj"), "up": ("w3", "up_proj"), "down": ("w2", "down_proj")}[which]
        for n in names:
            if f"{m}.{e}.{n}.weight" in self.index:
                return self._raw(f"{m}.{e}.{n}.weight")
        if which == "down":
            return self._raw(f"{m}.down_proj")[e]
        gate, up = np.split(self._raw(f"{m}.gate_up_proj")[e], 2)
        return gate if which == "gate" else up

    def get(self, name: str) -> np.ndarray:
        if name == "embed":
            return self._raw("model.embed_tokens.weight")
        if name == "out_norm":
            return self._raw("model.norm.weight")
        if name == "head":
            return self._raw("lm_head.weight")
        _, i, part = name.split(".", 2)
        p = f"model.layers.{i}"
        if part.startswith("exp."):
            _, e, which = part.split(".")
            if which == "gate_up":
                return np.concatenate([self._expert(i, int(e), "gate"), self._expert(i, int(e), "up")])
            return self._expert(i, int(e), "down")
        if part == "attn_qkv":
            return np.concatenate([self._raw(f"{p}.self_attn.{x}_proj.weight") for x in "qkv"])
        if part == "attn_qkv_bias":
            return np.concatenate([self._raw(f"{p}.self_attn.{x}_proj.bias") for x in "qkv"])
        if part == "ffn_gate_up":
            return np.concatenate([self._raw(f"{p}.mlp.gate_proj.weight"), self._raw(f"{p}.mlp.up_proj.weight")])
        if part == "ffn_shexp_gate_up":
            return np.concatenate(
                [
                    self._raw(f"{p}.mlp.shared_expert.gate_proj.weight"),
                    self._raw(f"{p}.mlp.shared_expert.up_proj.weight"),
                ]
            )
        plain = {
            "attn_norm": "input_layernorm.weight",
            "attn_out": "self_attn.o_proj.weight",
            "ffn_norm": "post_attention_layernorm.weight",
            "ffn_down": "mlp.down_proj.weight",
            "attn_q_norm": "self_attn.q_norm.weight",
            "attn_k_norm": "self_attn.k_norm.weight",
            "ffn_router": f"{self.moe_prefix}.gate.weight",
            "ffn_shexp_gate": "mlp.shared_expert_gate.weight",
            "ffn_shexp_down": "mlp.shared_expert.down_proj.weight",
        }
        return self._raw(f"{p}.{plain[part]}")


# Keys transformers 4 and 5 spell differently when they save a config (the config classes' attribute maps:
# transformers 5 writes Qwen3-MoE's and Mixtral's expert count as num_local_experts, OLMoE's as num_experts;
# it moves rope_theta and rope_scaling into rope_parameters, and a sliding window into layer_types).
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts")
# what transformers' config classes default to where a hand-written config.json leaves a key out
_DEFAULT_THETA = {"mixtral": 1e6}
_DEFAULT_EPS = {"mixtral": 1e-5, "olmoe": 1e-5}


def hf_args(cfg: dict, path: Path, qkv_bias: bool, tied: bool) -> ModelArgs:
    """ModelArgs from an HF config.json at `path` (its `model_type` one of HF_ARCHS), as transformers 4 or 5
    writes it; a field missing or of the wrong type ends in one sentence naming the file."""
    mt = cfg.get("model_type")
    if mt not in HF_ARCHS:
        raise CadenceError(f"{path}: model_type '{mt}' is not supported; cadence runs {', '.join(HF_ARCHS)} models")
    try:
        return _hf_args(cfg, mt, path, qkv_bias, tied)
    except KeyError as e:
        raise CadenceError(f"{path} has no {e} field, which a {mt} config needs; re-download it") from None
    except (TypeError, ValueError, AttributeError) as e:
        raise CadenceError(f"{path} has a field of the wrong kind for a {mt} config ({e}); re-download it") from None


def _rope(cfg: dict) -> dict:
    """The rope settings: transformers 5's rope_parameters (flat, or one per layer type), else 4's rope_scaling
    beside a top-level rope_theta."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if "full_attention" in rope and isinstance(rope["full_attention"], dict):
        rope = rope["full_attention"]
    theta = rope.get("rope_theta") or cfg.get("rope_theta") or _DEFAULT_THETA.get(cfg["model_type"], 1e4)
    return {**rope, "rope_theta": theta}


def _hf_args(cfg: dict, mt: str, path: Path, qkv_bias: bool, tied: bool) -> ModelArgs:
    rope = _rope(cfg)
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise CadenceError(f"{path}: rope scaling '{rope.get('rope_type', rope.get('type'))}' is not supported")
    if cfg.get("clip_qkv") is not None:
        raise CadenceError(f"{path}: clip_qkv={cfg['clip_qkv']} is not supported")
    layer_types = cfg.get("layer_types")  # transformers 5; 4 said use_sliding_window (Mixtral: a sliding_window)
    sliding = (
        set(layer_types) != {"full_attention"} if layer_types else mt == "mixtral" or cfg.get("use_sliding_window")
    )
    context = int(cfg.get("max_position_embeddings") or 2048)
    if sliding and cfg.get("sliding_window"):  # within its window, sliding-window attention is full attention
        context = min(context, int(cfg["sliding_window"]))
    moe = mt in NORM_TOPK
    if moe and (cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1):
        raise CadenceError(
            f"{path}: dense layers among the expert layers (mlp_only_layers, decoder_sparse_step) are not supported"
        )
    n_experts = next((cfg[k] for k in EXPERT_COUNT_KEYS if cfg.get(k)), 0) if moe else 0
    if moe and not n_experts:
        raise CadenceError(
            f"{path} gives no expert count ({' or '.join(EXPERT_COUNT_KEYS)}), which a {mt} model needs; re-download it"
        )
    n_heads = int(cfg["num_attention_heads"])
    return ModelArgs(
        arch=mt,
        vocab_size=int(cfg["vocab_size"]),
        dim=int(cfg["hidden_size"]),
        n_layers=int(cfg["num_hidden_layers"]),
        n_heads=n_heads,
        n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
        ffn_dim=int(cfg["intermediate_size"]),
        norm_eps=float(cfg.get("rms_norm_eps") or _DEFAULT_EPS.get(mt, 1e-6)),
        rope_base=float(rope["rope_theta"]),
        context_length=context,
        qkv_bias=qkv_bias,
        tied_embeddings=tied,
        head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // n_heads),
        qk_norm={"qwen3": "head", "qwen3_moe": "head", "olmoe": "full"}.get(mt, ""),
        n_experts=int(n_experts),
        n_experts_used=int(cfg.get("num_experts_per_tok") or 0) if moe else 0,
        expert_ffn_dim=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]) if moe else 0,
        shared_ffn_dim=int(cfg.get("shared_expert_intermediate_size") or 0) if mt == "qwen2_moe" else 0,
        norm_topk=True if mt == "mixtral" else bool(cfg.get("norm_topk_prob", False)) if moe else False,
    )
