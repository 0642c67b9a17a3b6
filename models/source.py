"""Model sources: a GGUF file or an HF directory, read as float32 tensors under canonical names.

Canonical names are the weight store's (see `canonical_names`): q/k/v are fused into one
`attn_qkv` matrix and gate/up into `ffn_gate_up`, all in HF's layout ([out, in], rotate-half
RoPE), so the engine has one layout whatever the source.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from cadence.errors import CadenceError
from models.config import ModelArgs
from models.gguf_file import GGUFFile
from models.tokenizer import TokenizerInfo, info_from_hf, tokenizer_from_gguf_fields


def canonical_names(args: ModelArgs) -> list[tuple[str, str]]:
    """(group, tensor) in the order a layer-by-layer reader needs them."""
    names = [("embed", "embed")]
    for i in range(args.n_layers):
        g = f"layer.{i}"
        names += [(g, f"blk.{i}.attn_norm"), (g, f"blk.{i}.attn_qkv")]
        if args.qkv_bias:
            names.append((g, f"blk.{i}.attn_qkv_bias"))
        names += [(g, f"blk.{i}.attn_out"), (g, f"blk.{i}.ffn_norm"), (g, f"blk.{i}.ffn_gate_up"), (g, f"blk.{i}.ffn_down")]
    names.append(("head", "out_norm"))
    if not args.tied_embeddings:
        names.append(("head", "head"))
    return names


def sha256_file(path: Path, chunk: int = 16 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (GGUF llama stores rotary pairs interleaved)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


class GGUFSource:
    kind = "gguf"

    def __init__(self, path: Path, sha256: str | None = None):
        self.path = Path(path)
        if not self.path.is_file():
            raise CadenceError(f"model file {self.path} does not exist; run `launch models pull` or check the path")
        self.file = GGUFFile(self.path)
        self.tensors = self.file.tensors
        if not self.tensors:
            raise CadenceError(f"{self.path} holds no tensors; re-download it")
        self._sha256 = sha256
        try:
            self.args = self._args()
            self.tokenizer = self._tokenizer()
        except CadenceError:
            raise
        except Exception as e:  # noqa: BLE001 - a field with a garbled value fails anywhere (tokenizers raises bare Exception)
            raise CadenceError(f"{self.path} is a damaged GGUF file (its model fields do not make a model: {e}); "
                               "re-download it") from None

    def _field(self, key: str, default=None):
        return self.file.fields.get(key, default)

    def _args(self) -> ModelArgs:
        arch = self._field("general.architecture")
        if arch not in ("llama", "qwen2"):
            raise CadenceError(f"{self.path.name}: architecture '{arch}' is not supported; cadence runs llama and qwen2 models")
        a = lambda k, d=None: self._field(f"{arch}.{k}", d)
        n_heads = int(a("attention.head_count"))
        dim = int(a("embedding_length"))
        scaling = a("rope.scaling.type")
        if scaling not in (None, "none"):
            raise CadenceError(f"{self.path.name}: rope scaling '{scaling}' is not supported")
        return ModelArgs(
            arch=arch,
            vocab_size=int(self.tensors["token_embd.weight"].shape[0]),
            dim=dim,
            n_layers=int(a("block_count")),
            n_heads=n_heads,
            n_kv_heads=int(a("attention.head_count_kv", n_heads)),
            ffn_dim=int(a("feed_forward_length")),
            norm_eps=float(a("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_base=float(a("rope.freq_base", 10000.0)),
            context_length=int(a("context_length", 2048)),
            qkv_bias="blk.0.attn_q.bias" in self.tensors,
            tied_embeddings="output.weight" not in self.tensors,
            head_dim=int(a("attention.key_length", dim // n_heads)),
        )

    def _tokenizer(self) -> TokenizerInfo:
        model = self._field("tokenizer.ggml.model")
        if model != "gpt2":
            raise CadenceError(f"{self.path.name}: tokenizer type '{model}' is not supported (cadence reads byte-level BPE)")
        tokens = self._field("tokenizer.ggml.tokens")
        tok = tokenizer_from_gguf_fields(tokens, self._field("tokenizer.ggml.token_type", []),
                                         self._field("tokenizer.ggml.merges", []), self._field("tokenizer.ggml.pre", "default"))
        bos, eos = self._field("tokenizer.ggml.bos_token_id"), self._field("tokenizer.ggml.eos_token_id")
        return TokenizerInfo(
            tokenizer_json=tok.to_str(), bos_id=None if bos is None else int(bos),
            eos_ids=[] if eos is None else [int(eos)], add_bos=bool(self._field("tokenizer.ggml.add_bos_token", False)),
            chat_template=self._field("tokenizer.chat_template"),
            special={"bos": tokens[bos] if bos is not None else "", "eos": tokens[eos] if eos is not None else ""},
        )

    def identity(self) -> str:
        if self._sha256 is None:
            self._sha256 = sha256_file(self.path)
        return self._sha256

    def _raw(self, name: str) -> np.ndarray:
        if name not in self.tensors:
            raise CadenceError(f"{self.path.name} has no tensor '{name}'; it is not a complete {self.args.arch} model")
        return self.file.read(name)

    def get(self, name: str) -> np.ndarray:
        a = self.args
        if name == "embed":
            return self._raw("token_embd.weight")
        if name == "out_norm":
            return self._raw("output_norm.weight")
        if name == "head":
            return self._raw("output.weight")
        _, i, part = name.split(".", 2)
        b = f"blk.{i}"
        llama = a.arch == "llama"
        if part == "attn_qkv":
            q, k = self._raw(f"{b}.attn_q.weight"), self._raw(f"{b}.attn_k.weight")
            if llama:
                q, k = _unpermute(q, a.n_heads), _unpermute(k, a.n_kv_heads)
            return np.concatenate([q, k, self._raw(f"{b}.attn_v.weight")])
        if part == "attn_qkv_bias":
            q, k = self._raw(f"{b}.attn_q.bias"), self._raw(f"{b}.attn_k.bias")
            if llama:
                q, k = _unpermute(q, a.n_heads), _unpermute(k, a.n_kv_heads)
            return np.concatenate([q, k, self._raw(f"{b}.attn_v.bias")])
        if part == "ffn_gate_up":
            return np.concatenate([self._raw(f"{b}.ffn_gate.weight"), self._raw(f"{b}.ffn_up.weight")])
        plain = {"attn_norm": "attn_norm.weight", "attn_out": "attn_output.weight", "ffn_norm": "ffn_norm.weight",
                 "ffn_down": "ffn_down.weight"}
        return self._raw(f"{b}.{plain[part]}")


class HFSource:
    """An HF model directory: config.json, *.safetensors, tokenizer.json."""
    kind = "hf"

    def __init__(self, path: Path):
        from safetensors import safe_open

        self.path = Path(path)
        cfg_path = self.path / "config.json"
        if not cfg_path.is_file():
            raise CadenceError(f"{self.path} has no config.json; an HF model directory needs config.json, *.safetensors and tokenizer.json")
        try:
            cfg = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as e:
            raise CadenceError(f"{cfg_path} is not valid JSON ({e})") from None
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
        mt = cfg.get("model_type")
        if mt not in ("llama", "qwen2"):
            raise CadenceError(f"{self.path}: model_type '{mt}' is not supported; cadence runs llama and qwen2 models")
        n_heads = cfg["num_attention_heads"]
        tied = bool(cfg.get("tie_word_embeddings", False)) or "lm_head.weight" not in self.index
        self.args = ModelArgs(
            arch=mt, vocab_size=cfg["vocab_size"], dim=cfg["hidden_size"], n_layers=cfg["num_hidden_layers"],
            n_heads=n_heads, n_kv_heads=cfg.get("num_key_value_heads", n_heads), ffn_dim=cfg["intermediate_size"],
            norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_base=cfg.get("rope_theta", 10000.0),
            context_length=cfg.get("max_position_embeddings", 2048),
            qkv_bias="model.layers.0.self_attn.q_proj.bias" in self.index, tied_embeddings=tied,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
        )
        tj = self.path / "tokenizer.json"
        if not tj.is_file():
            raise CadenceError(f"{self.path} has no tokenizer.json")
        tc_path = self.path / "tokenizer_config.json"
        tc = json.loads(tc_path.read_text()) if tc_path.is_file() else {}
        self.tokenizer = info_from_hf(tj.read_text(), tc, cfg)
        self._files = files + [cfg_path, tj]

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

    def get(self, name: str) -> np.ndarray:
        if name == "embed":
            return self._raw("model.embed_tokens.weight")
        if name == "out_norm":
            return self._raw("model.norm.weight")
        if name == "head":
            return self._raw("lm_head.weight")
        _, i, part = name.split(".", 2)
        p = f"model.layers.{i}"
        if part == "attn_qkv":
            return np.concatenate([self._raw(f"{p}.self_attn.{x}_proj.weight") for x in "qkv"])
        if part == "attn_qkv_bias":
            return np.concatenate([self._raw(f"{p}.self_attn.{x}_proj.bias") for x in "qkv"])
        if part == "ffn_gate_up":
            return np.concatenate([self._raw(f"{p}.mlp.gate_proj.weight"), self._raw(f"{p}.mlp.up_proj.weight")])
        plain = {"attn_norm": "input_layernorm.weight", "attn_out": "self_attn.o_proj.weight",
                 "ffn_norm": "post_attention_layernorm.weight", "ffn_down": "mlp.down_proj.weight"}
        return self._raw(f"{p}.{plain[part]}")


def open_source(path: Path, sha256: str | None = None):
    path = Path(path)
    if path.is_dir():
        return HFSource(path)
    return GGUFSource(path, sha256)
