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
from models.files import what_is
from models.gguf_file import GGUFFile
from models.store import expert_group
from models.tokenizer import TokenizerInfo, tokenizer_from_gguf_fields


# GGUF's architecture names (llama.cpp's) -> ours; a llama file with experts is a Mixtral
GGUF_ARCHS = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen2moe": "qwen2_moe",
    "qwen3moe": "qwen3_moe",
    "olmoe": "olmoe",
}
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
    return {
        "attn_norm": (a.dim,),
        "ffn_norm": (a.dim,),
        "out_norm": (a.dim,),
        "attn_qkv": (qkv, a.dim),
        "attn_qkv_bias": (qkv,),
        "attn_out": (a.dim, a.q_dim),
        "ffn_gate_up": (2 * a.ffn_dim, a.dim),
        "ffn_down": (a.dim, a.ffn_dim),
        "attn_q_norm": (norm_width or a.q_dim,),
        "attn_k_norm": (norm_width or a.kv_dim,),
        "ffn_router": (a.n_experts, a.dim),
        "ffn_shexp_gate": (1, a.dim),
        "ffn_shexp_gate_up": (2 * a.shared_ffn_dim, a.dim),
        "ffn_shexp_down": (a.dim, a.shared_ffn_dim),
        "gate_up": (2 * a.expert_ffn_dim, a.dim),
        "down": (a.dim, a.expert_ffn_dim),
    }[part]


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
            raise CadenceError(
                f"{self.path} is a damaged GGUF file (its model fields do not make a model: {e}); re-download it"
            ) from None

    def _field(self, key: str, default=None):
        return self.file.fields.get(key, default)

    def _args(self) -> ModelArgs:
        arch = self._field("general.architecture")
        if arch not in GGUF_ARCHS:
            raise CadenceError(
                f"{self.path.name}: architecture '{arch}' is not supported; cadence runs {', '.join(GGUF_ARCHS)} models"
            )
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
            raise CadenceError(
                f"{self.path.name}: its experts are stored one tensor each (an old layout); "
                "convert it again with a recent llama.cpp (ffn_*_exps tensors)"
            )
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
            raise CadenceError(
                f"{self.path.name}: tokenizer type '{model}' is not supported (cadence reads byte-level BPE)"
            )
        tokens = self._field("tokenizer.ggml.tokens")
        tok = tokenizer_from_gguf_fields(
            tokens,
            self._field("tokenizer.ggml.token_type", []),
            self._field("tokenizer.ggml.merges", []),
            self._field("tokenizer.ggml.pre", "default"),
        )
        bos, eos = self._field("tokenizer.ggml.bos_token_id"), self._field("tokenizer.ggml.eos_token_id")
        return TokenizerInfo(
            tokenizer_json=tok.to_str(),
            bos_id=None if bos is None else int(bos),
            eos_ids=[] if eos is None else [int(eos)],
            add_bos=bool(self._field("tokenizer.ggml.add_bos_token", False)),
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
                return np.concatenate(
                    [self._raw(f"{b}.ffn_gate_exps.weight", int(e)), self._raw(f"{b}.ffn_up_exps.weight", int(e))]
                )
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
        plain = {
            "attn_norm": "attn_norm.weight",
            "attn_out": "attn_output.weight",
            "ffn_norm": "ffn_norm.weight",
            "ffn_down": "ffn_down.weight",
            "attn_q_norm": "attn_q_norm.weight",
            "attn_k_norm": "attn_k_norm.weight",
            "ffn_router": "ffn_gate_inp.weight",
            "ffn_shexp_down": "ffn_down_shexp.weight",
        }
        return self._raw(f"{b}.{plain[part]}")
