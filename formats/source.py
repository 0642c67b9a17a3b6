"""Model sources: a GGUF file or an HF directory, read as float32 tensors under canonical names.

Canonical names are the weight store's (see `canonical_names`): q/k/v are fused into one
`attn_qkv` matrix and gate/up into `ffn_gate_up`, all in HF's layout ([out, in], rotate-half
RoPE), so the engine has one layout whatever the source. Which tensors and keys a file holds for a
family is the family's (models/families/); a tensor or key no family reads is refused, never skipped.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from common.errors import CadenceError
from models.args import ModelArgs
from models.families import BY_GGUF, BY_NAME, FAMILIES
from models.families.base import (
    COMMON_GGUF_KEYS,
    Family,
    Unsupported,
    deinterleave,
    gguf_rope,
    permute_partial,
    unpermute,
)
from models.families.pending import pending
from common.files import what_is
from formats.gguf_file import GGUFFile
from formats.store import expert_group
from text.tokenizer import TokenizerInfo
from text.tokenizer_gguf import info_from_gguf

# whether each model renormalises its top-k routing weights (llama.cpp's defaults; HF configs say it themselves)
NORM_TOPK = {"qwen2_moe": False, "qwen3_moe": True, "olmoe": False, "mixtral": True}
_MOE_GGUF_KEYS = frozenset(
    "expert_count expert_used_count expert_feed_forward_length expert_shared_feed_forward_length "
    "expert_weights_norm".split()
)
_METADATA = ("general.", "tokenizer.", "quantize.", "split.")
SSM_PARTS = ("ssm_in", "ssm_conv", "ssm_conv_b", "ssm_dt", "ssm_a", "ssm_d", "ssm_norm", "ssm_out")
NORMS = (
    "attn_norm",
    "ffn_norm",
    "attn_post_norm",
    "ffn_post_norm",
    "attn_q_norm",
    "attn_k_norm",
    "out_norm",
    "ple_post_norm",
    "ffn_post_norm_1",
    "ffn_norm_2",
    "ffn_post_norm_2",
)


def _mixer_names(args: ModelArgs, i: int, g: str, b: str) -> list[tuple[str, str]]:
    """Layer i's mixer's tensors: attention's, or a recurrent layer's (models/recurrent.py)."""
    names = [(g, f"{b}.attn_norm")] if args.pre(i) else []
    parts = []
    if args.conv(i):
        parts = ["conv_in", "conv_w", "conv_out"]
    elif i in args.gdn_layers:
        parts = ["gdn_in", "gdn_conv", "gdn_dt", "gdn_a", "gdn_norm", "gdn_out"]
    elif i in args.ssm_layers:
        parts = [
            p
            for p in SSM_PARTS
            if (p != "ssm_conv_b" or args.ssm_conv_bias) and (p != "ssm_norm" or args.ssm_norm != "none")
        ]
    if args.attends(i) and args.mla_kv_rank:  # latent attention (models/mla.py)
        parts += ["attn_q_a", "attn_q_a_norm"] * bool(args.mla_q_rank)
        parts += ["attn_q", "attn_kv_a", "attn_kv_a_norm", "attn_kv_b", "attn_out"]
    elif args.attends(i):
        norms = ["attn_q_norm", "attn_k_norm"][: 1 if args.shares_kv(i) else 2] * (args.qk_norm in ("head", "full"))
        parts += ["attn_qkv"] + ["attn_qkv_bias"] * args.qkv_bias + norms
        parts += ["attn_gate"] * args.attn_gate + ["attn_sinks"] * args.attn_sinks + ["attn_out"]
        parts += ["attn_out_bias"] * args.attn_out_bias
    names += [(g, f"{b}.{p}") for p in parts]
    return names + ([(g, f"{b}.attn_post_norm")] if args.post(i) else [])


def _ffn_parts(args: ModelArgs, i: int) -> list[str]:
    """Layer i's FFN tensors in its own group after its pre-norm: a dense FFN's, a mixture's router (and shared
    expert), or both beside each other with norms of their own (Gemma 4's 26B); then what ends the layer."""
    dense = not args.experts_at(i) or args.experts_beside_dense
    parts = ["ffn_gate_up", "ffn_down"] * dense
    parts += ["ffn_post_norm_1", "ffn_norm_2", "ffn_post_norm_2"] * args.experts_beside_dense
    parts += ["ffn_post_norm"] * (args.post(i) and dense)
    if args.experts_at(i):
        parts += ["ffn_router"] + ["ffn_router_bias"] * args.router_bias + ["ffn_router_sel"] * args.router_select_bias
        parts += ["ffn_router_scale", "ffn_expert_scale"] * args.experts_beside_dense
        parts += ["ffn_shexp_gate"] * (bool(args.shared_ffn_dim) and args.shared_gated)
        parts += ["ffn_shexp_gate_up", "ffn_shexp_down"] * bool(args.shared_ffn_dim)
    parts += ["ple_gate", "ple_out", "ple_post_norm"] * bool(args.ple_dim)
    return parts + ["layer_scale"] * args.layer_scale


def canonical_names(args: ModelArgs) -> list[tuple[str, str]]:
    """(group, tensor) in the order a layer-by-layer reader needs them.

    A mixture of experts keeps in `layer.<i>` what every token uses (attention, the router, a shared
    expert) and gives each expert a group of its own, `expert.<i>.<e>` (gate and up rows, then down),
    right after its layer's: an expert is one contiguous read.
    """
    names = [("embed", "embed")] + [("embed", "embed_pl")] * bool(args.ple_dim)
    for i in range(args.n_layers):
        g, b = f"layer.{i}", f"blk.{i}"
        if i == 0 and args.ple_dim:  # per-layer embeddings' projection of the embeddings, needed before layer 0
            names += [(g, "blk.0.ple_proj"), (g, "blk.0.ple_proj_norm")]
        names += _mixer_names(args, i, g, b) if args.mixes(i) else []
        if not args.has_ffn(i):
            continue
        names += [(g, f"{b}.ffn_norm")] if args.pre(i) else []
        names += [(g, f"{b}.{p}") for p in _ffn_parts(args, i)]
        if not args.experts_at(i):
            continue
        for e in range(args.n_experts):
            parts = ("gate_up", "gate_up_bias", "down", "down_bias") if args.expert_bias else ("gate_up", "down")
            names += [(expert_group(i, e), f"{b}.exp.{e}.{p}") for p in parts]
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


def qkv_layout(w: np.ndarray, args: ModelArgs, permuted: bool = False, interleaved: bool = False) -> np.ndarray:
    """A fused q/k/v matrix (or bias) in the engine's layout: llama.cpp's interleaved q/k rows put back
    (`permuted`), a model's own interleaved pairs put in rotate-half order (`interleaved`: GLM-4), a partial
    rotary's lanes moved to the front halves (models/families/base.py)."""
    if not (permuted or interleaved or args.rope_dim):
        return w  # (its rows as they are: Gemma 4's layers have q/k/v of their own sizes)
    q, k, v = np.split(w, [args.q_dim, args.q_dim + args.kv_dim])
    if permuted:
        q, k = unpermute(q, args.n_heads), unpermute(k, args.n_kv_heads)
    if interleaved:
        lanes = args.rope_dim or args.head_dim
        q = deinterleave(q, args.n_heads, args.head_dim, lanes)
        k = deinterleave(k, args.n_kv_heads, args.head_dim, lanes)
    if args.rope_dim:
        q = permute_partial(q, args.n_heads, args.head_dim, args.rope_dim)
        k = permute_partial(k, args.n_kv_heads, args.head_dim, args.rope_dim)
    return np.concatenate([q, k, v])


def head_norm_layout(w: np.ndarray, args: ModelArgs, interleaved: bool = False) -> np.ndarray:
    """A per-head q/k norm's weights [head_dim] with their lanes where `qkv_layout` moved the heads' lanes."""
    if args.qk_norm != "head":
        return w
    if interleaved:
        w = deinterleave(w.reshape(-1, 1), 1, args.head_dim, args.rope_dim or args.head_dim).reshape(-1)
    return permute_partial(w.reshape(-1, 1), 1, args.head_dim, args.rope_dim).reshape(-1) if args.rope_dim else w


def _per_layer(value, what: str, origin: str) -> int:
    """A GGUF's kv heads or FFN width: one, or one a layer (llama.cpp's LFM2 and Nemotron-H: 0 kv heads for a layer
    that does not attend, 0 width for one with no FFN; the family tells those layers apart), all others alike."""
    if not isinstance(value, list):
        return int(value)
    counts = {int(x) for x in value if int(x)}
    if len(counts) != 1:
        raise CadenceError(f"{origin}: layers with different {what} ({sorted(counts)}) are not supported")
    return counts.pop()


def refuse_unknown(what: str, names, origin: str, family: Family, advice: str) -> None:
    """One sentence naming the first thing a file holds that no family reads: cadence would compute without it."""
    names = sorted(names)
    if names:
        more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
        raise CadenceError(
            f"{origin} has {what} '{names[0]}'{more} that cadence does not use for a {family.name} model, "
            f"so it would compute something else; {advice}"
        )


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
        except Unsupported as e:  # a family's reader met a part cadence does not run
            raise CadenceError(f"{self.path}: {e} is not something cadence runs yet") from None
        except Exception as e:  # noqa: BLE001 - a field with a garbled value fails anywhere (tokenizers raises bare Exception)
            raise CadenceError(
                f"{self.path} is a damaged GGUF file (its model fields do not make a model: {e}); re-download it"
            ) from None
        self._check_names()

    def _field(self, key: str, default=None):
        return self.file.fields.get(key, default)

    def _args(self) -> ModelArgs:
        arch = self._field("general.architecture")
        moe = any(n.endswith((".ffn_gate_exps.weight", ".ffn_gate_up_exps.weight")) for n in self.tensors)
        fam = BY_NAME["mixtral"] if arch == "llama" and moe else BY_GGUF.get(arch)
        if arch == "olmo2" and f"{arch}.attention.sliding_window" in self.file.fields:
            fam = BY_NAME["olmo3"]  # llama.cpp's olmo2 with a window
        if fam is None:
            known = ", ".join(sorted(a for f in FAMILIES for a in f.gguf_archs))
            raise CadenceError(
                f"{self.path.name}: architecture '{arch}' is not supported{pending('gguf', arch)}; "
                f"cadence runs {known} models"
            )
        self.gguf_arch, self.family = arch, fam
        if int(self._field("split.count", 1)) > 1:
            raise CadenceError(
                f"{self.path.name} is one part of a split GGUF; join the parts first (llama.cpp's gguf-split --merge)"
            )
        a = lambda k, d=None: self._field(f"{arch}.{k}", d)
        lists = fam.gguf_layer_lists  # keys one a layer the family reads itself: the common fields take layer 0's
        a0 = lambda k, d=None: (lambda v: v[0] if isinstance(v, list) and k in lists else v)(a(k, d))
        if isinstance(a("attention.head_count"), list):
            raise CadenceError(f"{self.path.name}: layers of different widths are not supported")
        n_heads, dim = int(a("attention.head_count")), int(a("embedding_length"))
        # (MLA written as MQA: key_length and value_length the latent's; `_mla` the heads' after it)
        head_dim = int(a("attention.key_length_mla", a("attention.key_length", dim // n_heads)))
        if int(a("attention.value_length_mla", a("attention.value_length", head_dim))) != head_dim:
            raise CadenceError(f"{self.path.name}: values narrower or wider than keys are not supported")
        if a("expert_count") and not moe:
            raise CadenceError(
                f"{self.path.name}: its experts are stored one tensor each (an old layout); "
                "convert it again with a recent llama.cpp (ffn_*_exps tensors)"
            )
        common = dict(
            vocab_size=int(self.tensors["token_embd.weight"].shape[0]),
            dim=dim,
            n_layers=int(a("block_count")),
            n_heads=n_heads,
            n_kv_heads=_per_layer(a0("attention.head_count_kv", n_heads), "numbers of kv heads", self.path.name),
            ffn_dim=_per_layer(a0("feed_forward_length", 0), "FFN widths", self.path.name)
            or int(self.tensors["blk.0.ffn_gate_exps.weight"].shape[1]),
            norm_eps=float(a("attention.layer_norm_rms_epsilon", 1e-6)),
            context_length=int(a("context_length", 2048)),
            head_dim=head_dim,
        )
        rope_dim = int(a("rope.dimension_count", head_dim))
        common |= dict(rope_base=float(a("rope.freq_base", 10000.0)), rope_dim=rope_dim if rope_dim < head_dim else 0)
        common |= gguf_rope(a, self.tensors, self.file.read)
        self._consumed = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}
        return ModelArgs(
            arch=fam.name,
            qkv_bias="blk.0.attn_q.bias" in self.tensors or "blk.0.attn_qkv.bias" in self.tensors,
            tied_embeddings="output.weight" not in self.tensors,
            **{**fam.block, **common, **self._moe(a, moe, fam), **fam.gguf_fields(a, common)}
            | fam.gguf_tensor_fields(self.tensors),
        )

    def _moe(self, a, moe: bool, fam: Family) -> dict:
        if not moe:
            return {}
        n = int(a("block_count"))
        gates = ("ffn_gate_exps", "ffn_gate_up_exps")  # gate and up apart, or fused (gate rows first)
        first, gate = next((i, g) for i in range(n) for g in gates if f"blk.{i}.{g}.weight" in self.tensors)
        shexp = self.tensors.get(f"blk.{first}.ffn_gate_shexp.weight")
        exps = self.tensors[f"blk.{first}.{gate}.weight"]
        dense = tuple(i for i in range(n) if f"blk.{i}.ffn_down.weight" in self.tensors)  # dense FFNs among them
        return dict(
            **({"dense_layers": dense} if dense else {}),
            n_experts=int(exps.shape[0]),
            n_experts_used=int(a("expert_used_count", 0)),
            expert_ffn_dim=int(exps.shape[1]) // (1 + (gate == "ffn_gate_up_exps")),
            shared_ffn_dim=int(shexp.shape[0]) if shexp is not None else 0,
            norm_topk=bool(a("expert_weights_norm", NORM_TOPK.get(fam.name, False))),
        )

    def _check_names(self) -> None:
        """Every key under the architecture and every tensor is one this family reads."""
        arch, fam = self.gguf_arch, self.family
        known = COMMON_GGUF_KEYS | fam.gguf_keys | _MOE_GGUF_KEYS
        keys = [
            k
            for k in self.file.fields
            if not k.startswith(_METADATA) and not (k.startswith(f"{arch}.") and k[len(arch) + 1 :] in known)
        ]
        advice = "it is a variant of the model cadence does not run (tell us which model it is)"
        refuse_unknown("the key", keys, self.path.name, fam, advice)
        used = set(self._consumed)
        for _, name in canonical_names(self.args):
            used |= set(self._sources(name))
        if a := self._field(f"{arch}.nextn_predict_layers"):  # multi-token prediction layers: a draft of its own
            used |= {t for t in self.tensors if t.startswith(tuple(f"blk.{self.args.n_layers + j}." for j in range(a)))}
        refuse_unknown("the tensor", set(self.tensors) - used, self.path.name, fam, advice)

    def _sources(self, name: str) -> list[str]:
        """The GGUF tensors a canonical tensor is made of."""
        if name in self.family.gguf_globals:
            return [self.family.gguf_globals[name]]
        if name == "embed":
            return ["token_embd.weight"]
        if name in ("out_norm", "head"):
            return [
                f"{self.family.gguf_names.get(name, ('output_norm',))[0]}.weight"
                if name == "out_norm"
                else "output.weight"
            ]
        _, i, part = name.split(".", 2)
        b = f"blk.{i}"
        if part.startswith("exp."):  # an expert's weights or biases (gpt-oss)
            which = part.split(".")[2]
            kind = "bias" if which.endswith("_bias") else "weight"
            pair = ("gate", "up") if which.startswith("gate_up") else ("down",)
            if pair == ("gate", "up") and f"{b}.ffn_gate_up_exps.{kind}" in self.tensors:
                pair = ("gate_up",)
            return [f"{b}.ffn_{x}_exps.{kind}" for x in pair]
        moe = {
            "ffn_router": ["ffn_gate_inp"],
            "ffn_shexp_gate": ["ffn_gate_inp_shexp"],
            "ffn_shexp_gate_up": ["ffn_gate_shexp", "ffn_up_shexp"],
            "ffn_shexp_down": ["ffn_down_shexp"],
        }
        if part == "attn_qkv_bias":
            return [f"{b}.{n}.bias" for n in self.family.gguf_tensors("attn_qkv")]
        if part in self.family.gguf_params:
            return [f"{b}.{n}" for n in self.family.gguf_tensors(part)]
        own = self.family.gguf_layer_tensors(int(i), part, self.args)
        return [f"{b}.{n}.weight" for n in own or moe.get(part) or self.family.gguf_tensors(part)]

    def _tokenizer(self) -> TokenizerInfo:
        return info_from_gguf(self.file.fields, self.path.name, self.gguf_arch)

    def identity(self) -> str:
        if self._sha256 is None:
            self._sha256 = sha256_file(self.path)
        return self._sha256

    def _raw(self, name: str, index: int | None = None) -> np.ndarray:
        if name not in self.tensors:
            raise CadenceError(f"{self.path.name} has no tensor '{name}'; it is not a complete {self.args.arch} model")
        return self.file.read(name, index)

    def get(self, name: str) -> np.ndarray:
        if name == "head" and self.args.tied_embeddings:
            name = "embed"
        srcs = self._sources(name)
        if ".exp." in name:  # one expert of the [experts, out, in] tensors
            e = int(name.split(".")[3])
            return np.concatenate([self._raw(s, e) for s in srcs])
        if name.endswith("ffn_shexp_gate"):
            return self._raw(srcs[0]).reshape(1, self.args.dim)
        parts = [self.family.gguf_split(name, s, self._raw(s), self.args) for s in srcs]
        w = self.family.gguf_join(name, parts, self.args)
        if name.endswith(("attn_qkv", "attn_qkv_bias")):
            return qkv_layout(w, self.args, self.family.gguf_permuted, self.family.interleaved)
        if name.endswith(("attn_q_norm", "attn_k_norm")):
            return head_norm_layout(w, self.args, self.family.interleaved)
        return w
