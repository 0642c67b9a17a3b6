"""Model sources: a GGUF file or an HF directory, read as float32 tensors under canonical names.

Canonical names are the weight store's (see `canonical_names`): q/k/v are fused into one
`attn_qkv` matrix and gate/up into `ffn_gate_up`, all in HF's layout ([out, in], rotate-half
RoPE), so the engine has one layout whatever the source.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from common.errors import CadenceError
from models.config import ModelArgs
from models.files import read_json, read_text, what_is
from models.gguf_file import GGUFFile
from models.store import expert_group
from models.tokenizer import TokenizerInfo, info_from_hf, tokenizer_from_gguf_fields


# GGUF's architecture names (llama.cpp's) -> ours; a llama file with experts is a Mixtral
GGUF_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe",
              "olmoe": "olmoe"}
HF_ARCHS = ("llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "olmoe", "mixtral")
# whether each model renormalises its top-k routing weights (llama.cpp's defaults; HF configs say it themselves)
NORM_TOPK = {"qwen2_moe": False, "qwen3_moe": True, "olmoe": False, "mixtral": True}


def canonical_names(args: ModelArgs) -> list[tuple[str, str]]:
    """(group, tensor) in the order a layer-by-layer reader needs them.

    A mixture of experts keeps in `layer.<i>` what every token uses (attention, the router, a shared
    expert) and gives each expert a group of its own, `expert.<i>.<e>` (gate and up rows, then down),
    right after its layer's: an expert is one contiguous read.
    """
    names = [("embed", "embed")]
    for i in range(args.n_layers):
        g, b = f"layer.{i}", f"blk.{i}"
        names += [(g, f"{b}.attn_norm"), (g, f"{b}.attn_qkv")]
        if args.qkv_bias:
            names.append((g, f"{b}.attn_qkv_bias"))
        if args.qk_norm:
            names += [(g, f"{b}.attn_q_norm"), (g, f"{b}.attn_k_norm")]
        names += [(g, f"{b}.attn_out"), (g, f"{b}.ffn_norm")]
        if not args.moe:
            names += [(g, f"{b}.ffn_gate_up"), (g, f"{b}.ffn_down")]
            continue
        names.append((g, f"{b}.ffn_router"))
        if args.shared_ffn_dim:
            names += [(g, f"{b}.ffn_shexp_gate"), (g, f"{b}.ffn_shexp_gate_up"), (g, f"{b}.ffn_shexp_down")]
        for e in range(args.n_experts):
            names += [(expert_group(i, e), f"{b}.exp.{e}.gate_up"), (expert_group(i, e), f"{b}.exp.{e}.down")]
    names.append(("head", "out_norm"))
    if not args.tied_embeddings:
        names.append(("head", "head"))
    return names


def tensor_shape(args: ModelArgs, name: str) -> tuple[int, ...]:
    """The shape of a canonical tensor ([out, in] for weights)."""
    a = args
    if name in ("embed", "head"):
        return (a.vocab_size, a.dim)
    part = name.rsplit(".", 1)[-1]
    qkv = a.q_dim + 2 * a.kv_dim
    norm_width = {"head": a.head_dim, "full": None}.get(a.qk_norm)
    return {"attn_norm": (a.dim,), "ffn_norm": (a.dim,), "out_norm": (a.dim,), "attn_qkv": (qkv, a.dim),
            "attn_qkv_bias": (qkv,), "attn_out": (a.dim, a.q_dim), "ffn_gate_up": (2 * a.ffn_dim, a.dim),
            "ffn_down": (a.dim, a.ffn_dim), "attn_q_norm": (norm_width or a.q_dim,), "attn_k_norm": (norm_width or a.kv_dim,),
            "ffn_router": (a.n_experts, a.dim), "ffn_shexp_gate": (1, a.dim), "ffn_shexp_gate_up": (2 * a.shared_ffn_dim, a.dim),
            "ffn_shexp_down": (a.dim, a.shared_ffn_dim), "gate_up": (2 * a.expert_ffn_dim, a.dim),
            "down": (a.dim, a.expert_ffn_dim)}[part]


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
        if not self.path.exists():
            raise CadenceError(f"model file {self.path} does not exist; run `launch models pull` or check the path")
        if not self.path.is_file():  # /dev/zero, a pipe: read, they would never end
            raise CadenceError(f"{self.path} {what_is(self.path)}; give a .gguf file or an HF model directory")
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
        if arch not in GGUF_ARCHS:
            raise CadenceError(f"{self.path.name}: architecture '{arch}' is not supported; cadence runs "
                               f"{', '.join(GGUF_ARCHS)} models")
        self.gguf_arch = arch
        a = lambda k, d=None: self._field(f"{arch}.{k}", d)
        n_heads = int(a("attention.head_count"))
        dim = int(a("embedding_length"))
        scaling = a("rope.scaling.type")
        if scaling not in (None, "none"):
            raise CadenceError(f"{self.path.name}: rope scaling '{scaling}' is not supported")
        head_dim = int(a("attention.key_length", dim // n_heads))
        moe = "blk.0.ffn_gate_exps.weight" in self.tensors
        if a("expert_count") and not moe:
            raise CadenceError(f"{self.path.name}: its experts are stored one tensor each (an old layout); "
                               "convert it again with a recent llama.cpp (ffn_*_exps tensors)")
        qn = self.tensors.get("blk.0.attn_q_norm.weight")
        name = GGUF_ARCHS[arch] if not (arch == "llama" and moe) else "mixtral"
        shexp = self.tensors.get("blk.0.ffn_gate_shexp.weight")
        return ModelArgs(
            arch=name,
            vocab_size=int(self.tensors["token_embd.weight"].shape[0]),
            dim=dim,
            n_layers=int(a("block_count")),
            n_heads=n_heads,
            n_kv_heads=int(a("attention.head_count_kv", n_heads)),
            ffn_dim=int(a("feed_forward_length", 0)) or int(self.tensors["blk.0.ffn_gate_exps.weight"].shape[1]),
            norm_eps=float(a("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_base=float(a("rope.freq_base", 10000.0)),
            context_length=int(a("context_length", 2048)),
            qkv_bias="blk.0.attn_q.bias" in self.tensors,
            tied_embeddings="output.weight" not in self.tensors,
            head_dim=head_dim,
            qk_norm="" if qn is None else ("head" if qn.shape[0] == head_dim else "full"),
            n_experts=int(self.tensors["blk.0.ffn_gate_exps.weight"].shape[0]) if moe else 0,
            n_experts_used=int(a("expert_used_count", 0)) if moe else 0,
            expert_ffn_dim=int(self.tensors["blk.0.ffn_gate_exps.weight"].shape[1]) if moe else 0,
            shared_ffn_dim=int(shexp.shape[0]) if shexp is not None else 0,
            norm_topk=bool(a("expert_weights_norm", NORM_TOPK.get(name, False))) if moe else False,
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

    def _raw(self, name: str, index: int | None = None) -> np.ndarray:
        if name not in self.tensors:
            raise CadenceError(f"{self.path.name} has no tensor '{name}'; it is not a complete {self.args.arch} model")
        return self.file.read(name, index)

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
        llama = self.gguf_arch == "llama"
        if part.startswith("exp."):  # one expert of the [experts, out, in] tensors
            _, e, which = part.split(".")
            if which == "gate_up":
                return np.concatenate([self._raw(f"{b}.ffn_gate_exps.weight", int(e)), self._raw(f"{b}.ffn_up_exps.weight", int(e))])
            return self._raw(f"{b}.ffn_down_exps.weight", int(e))
        if part in ("attn_qkv", "attn_qkv_bias"):
            kind = "weight" if part == "attn_qkv" else "bias"
            q, k = self._raw(f"{b}.attn_q.{kind}"), self._raw(f"{b}.attn_k.{kind}")
            if llama:
                q, k = _unpermute(q, a.n_heads), _unpermute(k, a.n_kv_heads)
            return np.concatenate([q, k, self._raw(f"{b}.attn_v.{kind}")])
        if part in ("ffn_gate_up", "ffn_shexp_gate_up"):
            x = "_shexp" if part == "ffn_shexp_gate_up" else ""
            return np.concatenate([self._raw(f"{b}.ffn_gate{x}.weight"), self._raw(f"{b}.ffn_up{x}.weight")])
        if part == "ffn_shexp_gate":
            return self._raw(f"{b}.ffn_gate_inp_shexp.weight").reshape(1, a.dim)
        plain = {"attn_norm": "attn_norm.weight", "attn_out": "attn_output.weight", "ffn_norm": "ffn_norm.weight",
                 "ffn_down": "ffn_down.weight", "attn_q_norm": "attn_q_norm.weight", "attn_k_norm": "attn_k_norm.weight",
                 "ffn_router": "ffn_gate_inp.weight", "ffn_shexp_down": "ffn_down_shexp.weight"}
        return self._raw(f"{b}.{plain[part]}")


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
        self.args = hf_args(cfg, cfg_path, "model.layers.0.self_attn.q_proj.bias" in self.index,
                            bool(cfg.get("tie_word_embeddings", False)) or "lm_head.weight" not in self.index)
        self.moe_prefix = "block_sparse_moe" if self.args.arch == "mixtral" else "mlp"
        tc_path = self.path / "tokenizer_config.json"
        tc = read_json(tc_path, "re-download it") if tc_path.exists() else {}
        self.tokenizer = info_from_hf(read_text(tj, "re-download it"), tc, cfg, origin=str(tj))
        self._files = files + [cfg_path, tj]

    def _needs(self, name: str) -> Path:
        if not (self.path / name).exists():
            raise CadenceError(f"{self.path} has no {name}; an HF model directory needs config.json, *.safetensors "
                               "and tokenizer.json")
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
            return np.concatenate([self._raw(f"{p}.mlp.shared_expert.gate_proj.weight"),
                                   self._raw(f"{p}.mlp.shared_expert.up_proj.weight")])
        plain = {"attn_norm": "input_layernorm.weight", "attn_out": "self_attn.o_proj.weight",
                 "ffn_norm": "post_attention_layernorm.weight", "ffn_down": "mlp.down_proj.weight",
                 "attn_q_norm": "self_attn.q_norm.weight", "attn_k_norm": "self_attn.k_norm.weight",
                 "ffn_router": f"{self.moe_prefix}.gate.weight", "ffn_shexp_gate": "mlp.shared_expert_gate.weight",
                 "ffn_shexp_down": "mlp.shared_expert.down_proj.weight"}
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
    sliding = (set(layer_types) != {"full_attention"} if layer_types
               else mt == "mixtral" or cfg.get("use_sliding_window"))
    context = int(cfg.get("max_position_embeddings") or 2048)
    if sliding and cfg.get("sliding_window"):  # within its window, sliding-window attention is full attention
        context = min(context, int(cfg["sliding_window"]))
    moe = mt in NORM_TOPK
    if moe and (cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1):
        raise CadenceError(f"{path}: dense layers among the expert layers (mlp_only_layers, decoder_sparse_step) "
                           "are not supported")
    n_experts = next((cfg[k] for k in EXPERT_COUNT_KEYS if cfg.get(k)), 0) if moe else 0
    if moe and not n_experts:
        raise CadenceError(f"{path} gives no expert count ({' or '.join(EXPERT_COUNT_KEYS)}), which a {mt} model "
                           "needs; re-download it")
    n_heads = int(cfg["num_attention_heads"])
    return ModelArgs(
        arch=mt, vocab_size=int(cfg["vocab_size"]), dim=int(cfg["hidden_size"]), n_layers=int(cfg["num_hidden_layers"]),
        n_heads=n_heads, n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
        ffn_dim=int(cfg["intermediate_size"]),
        norm_eps=float(cfg.get("rms_norm_eps") or _DEFAULT_EPS.get(mt, 1e-6)), rope_base=float(rope["rope_theta"]),
        context_length=context, qkv_bias=qkv_bias, tied_embeddings=tied,
        head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // n_heads),
        qk_norm={"qwen3": "head", "qwen3_moe": "head", "olmoe": "full"}.get(mt, ""),
        n_experts=int(n_experts), n_experts_used=int(cfg.get("num_experts_per_tok") or 0) if moe else 0,
        expert_ffn_dim=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]) if moe else 0,
        shared_ffn_dim=int(cfg.get("shared_expert_intermediate_size") or 0) if mt == "qwen2_moe" else 0,
        norm_topk=True if mt == "mixtral" else bool(cfg.get("norm_topk_prob", False)) if moe else False,
    )


def open_source(path: Path, sha256: str | None = None):
    path = Path(path)
    if path.is_dir():
        return HFSource(path)
    return GGUFSource(path, sha256)
