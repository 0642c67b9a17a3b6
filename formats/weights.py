"""Weight providers: where the engine gets each layer's weights from.

The engine asks `provider.layer(i)` right before it computes layer i, so a provider may hold
every layer in RAM (`ResidentWeights`) or hand layers in as a loader brings them into shared
memory (the streaming provider of the memory-wall pipeline).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from models import linear
from models.args import ModelArgs
from models.linear import Linear
from formats.store import EmbeddingRows, WeightStore, expert_group, weights_buffer


# LayerWeights field -> the canonical tensor it is made of ("blk.<i>." + name), and whether it is a product (a
# `Linear` in the store's format) or a vector kept as float32
PARTS = {
    **{f: (p, True) for f, p in (("qkv", "attn_qkv"), ("attn_out", "attn_out"), ("gate_up", "ffn_gate_up"))},
    **{f: (p, True) for f, p in (("down", "ffn_down"), ("router", "ffn_router"), ("shexp_gate", "ffn_shexp_gate"))},
    **{f: ("ffn_" + f, True) for f in ("shexp_gate_up", "shexp_down")},
    **{f: (f, True) for f in ("conv_in", "conv_out", "attn_gate", "gdn_in", "gdn_out", "ssm_in", "ssm_out")},
    **{f: (p, False) for f, p in (("q_norm", "attn_q_norm"), ("k_norm", "attn_k_norm"))},
    **{f: (f, False) for f in ("attn_norm", "ffn_norm", "attn_post_norm", "ffn_post_norm", "conv_w")},
    **{f: (f, False) for f in ("gdn_conv", "gdn_dt", "gdn_a", "gdn_norm", "ssm_conv", "ssm_conv_b", "ssm_dt")},
    **{f: (f, False) for f in ("ssm_a", "ssm_d", "ssm_norm", "attn_sinks")},
    "router_sel": ("ffn_router_sel", False),
    **{f: (f, True) for f in ("ple_proj", "ple_gate", "ple_out")},
    **{f: (f, False) for f in ("ple_proj_norm", "ple_post_norm", "layer_scale")},
    **{f: ("ffn_" + f, False) for f in ("post_norm_1", "norm_2", "post_norm_2", "router_scale", "expert_scale")},
    **{f"mla_{p}": (f"attn_{p}", True) for p in ("q_a", "q", "kv_a", "kv_b")},
    **{f"mla_{p}": (f"attn_{p}", False) for p in ("q_a_norm", "kv_a_norm")},
}
BIASES = {"qkv": "attn_qkv_bias", "attn_out": "attn_out_bias", "router": "ffn_router_bias"}  # a product's bias


def layer_weights(i: int, product, vector) -> "LayerWeights":
    """Layer i's weights from `product(name, bias)` and `vector(name)`, each None for a tensor the layer lacks."""
    b = f"blk.{i}"
    bias = lambda f: vector(f"{b}.{BIASES[f]}") if f in BIASES else None  # noqa: E731
    return LayerWeights(
        **{f: product(f"{b}.{p}", bias(f)) if lin else vector(f"{b}.{p}") for f, (p, lin) in PARTS.items()}
    )


@dataclass
class LayerWeights:
    """A layer's weights that every token uses. A dense layer has its FFN (`gate_up`, `down`); a mixture of
    experts has its `router` (and a shared expert where the model has one); its experts are `ExpertWeights`."""

    attn_norm: torch.Tensor | None = None  # None: no norm before the branch (OLMo 2)
    qkv: Linear | None = None  # None: a recurrent layer (models/recurrent.py), its mixer below, or an FFN only
    attn_out: Linear | None = None
    ffn_norm: torch.Tensor | None = None
    gate_up: Linear | None = None
    down: Linear | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    router: Linear | None = None
    shexp_gate: Linear | None = None
    shexp_gate_up: Linear | None = None
    shexp_down: Linear | None = None
    attn_post_norm: torch.Tensor | None = None  # a norm of the branch's output before the residual add (Gemma, OLMo 2)
    ffn_post_norm: torch.Tensor | None = None
    flash: object | None = None  # LLM in a flash: the layer's FFN (flash/weights.py `FlashFFN`)
    kernel_record: torch.Tensor | None = None  # the layer as one kernel call takes it (models/layer_kernel.py)
    ssm_record: torch.Tensor | None = (
        None  # its Mamba-2 branch as one kernel call takes it (models/recurrent_kernels.py)
    )
    conv_in: Linear | None = None  # a short-convolution layer: [B | C | x~] from x, its taps [dim, K], its output
    conv_w: torch.Tensor | None = None
    conv_out: Linear | None = None
    attn_gate: Linear | None = None  # the attention output's gate (Qwen 3.5)
    gdn_in: Linear | None = None  # a gated delta-net: [q k v | z | b | a] from x, its convolution's taps, dt bias,
    gdn_conv: torch.Tensor | None = None  # A_log, its output norm (per value head) and projection
    gdn_dt: torch.Tensor | None = None
    gdn_a: torch.Tensor | None = None
    gdn_norm: torch.Tensor | None = None
    gdn_out: Linear | None = None
    ssm_in: Linear | None = None  # a Mamba-2 layer: [z | x B C | dt] from x, its convolution's taps and bias, dt
    ssm_conv: torch.Tensor | None = None  # bias, A_log, D, its gated group norm and output projection
    ssm_conv_b: torch.Tensor | None = None
    ssm_dt: torch.Tensor | None = None
    ssm_a: torch.Tensor | None = None
    ssm_d: torch.Tensor | None = None
    ssm_norm: torch.Tensor | None = None
    ssm_out: Linear | None = None
    attn_sinks: torch.Tensor | None = None  # gpt-oss: a logit per head in every softmax's denominator
    router_sel: torch.Tensor | None = None  # a bias on the router's scores that only chooses (LFM2-MoE, GLM-4.5)
    mla_q_a: Linear | None = None  # latent attention (models/mla.py): the queries' bottleneck, its norm, the
    mla_q_a_norm: torch.Tensor | None = None  # queries' projection; the latent and shared rotary key, the latent's
    mla_q: Linear | None = None  # norm, and its expansion to each head's key part and value
    mla_kv_a: Linear | None = None
    mla_kv_a_norm: torch.Tensor | None = None
    mla_kv_b: Linear | None = None
    ple_proj: Linear | None = None  # Gemma 4: the embeddings' projection to per-layer ones and its norm (layer 0),
    ple_proj_norm: torch.Tensor | None = None  # each layer's gate, output, its norm, and the layer's output scale
    ple_gate: Linear | None = None
    ple_out: Linear | None = None
    ple_post_norm: torch.Tensor | None = None
    layer_scale: torch.Tensor | None = None
    post_norm_1: torch.Tensor | None = None  # Gemma 4's 26B: the dense MLP's output norm, the experts' input and
    norm_2: torch.Tensor | None = None  # output norms, the scale of the router's input, each expert's weight
    post_norm_2: torch.Tensor | None = None
    router_scale: torch.Tensor | None = None
    expert_scale: torch.Tensor | None = None


@dataclass
class ExpertWeights:
    gate_up: Linear
    down: Linear

    @cached_property
    def table(self) -> torch.Tensor | None:
        """Both matrices as the fused expert kernel reads them (int64 [2, 9]), or None where it cannot
        (dense formats, no kernel)."""
        lins = (self.gate_up, self.down)
        if not all(isinstance(x, linear.QuantLinear) and x.kernel for x in lins):
            return None
        return torch.tensor([x.record() for x in lins], dtype=torch.int64)

    @cached_property
    def biases(self) -> torch.Tensor:
        """The addresses of both matrices' biases as the fused expert kernel reads them (int64 [2], 0: none); the
        biases float32 and contiguous (`Linear.bias`, kept alive by this expert)."""
        for x in (self.gate_up, self.down):
            if x.bias is not None and (x.bias.dtype != torch.float32 or not x.bias.is_contiguous()):
                x.bias = x.bias.float().contiguous()
        return torch.tensor([0 if x.bias is None else x.bias.data_ptr() for x in (self.gate_up, self.down)])


@dataclass
class HeadPart:
    """Token rows [lo, lo + out.n) of the output head; the first part also carries the final norm."""

    lo: int
    out: Linear
    norm: torch.Tensor | None = None
    rec: list | None = None

    def fold_record(self) -> list[int] | None:
        """Its first token and its product's record, as the one-call head folds it (models/kernels.py
        `head_argmax`); None where that kernel cannot take its rows (dense or biased ones, another device)."""
        if self.rec is None:
            out = self.out
            ok = isinstance(out, linear.QuantLinear) and out.kernel and out.bias is None
            self.rec = [self.lo, *out.record()] if ok else []
        return self.rec or None


def store_linear(store: WeightStore, name: str, arrays: dict[str, torch.Tensor], bias=None) -> Linear:
    entry = store.tensors[name]
    meta = {k: v for k, v in entry.items() if k not in ("format", "arrays", "rows")}
    return linear.decode(entry["format"], arrays, meta, bias)


def layer_from_views(store: WeightStore, i: int, views: dict[str, dict[str, torch.Tensor]]) -> LayerWeights:
    return layer_weights(
        i,
        lambda name, bias: store_linear(store, name, views[name], bias) if name in views else None,
        lambda name: views[name]["w"] if name in views else None,
    )


def expert_from_views(store: WeightStore, group: str, views: dict) -> ExpertWeights:
    _, i, e = group.split(".")
    b = f"blk.{i}.exp.{e}"
    bias = lambda p: views[f"{b}.{p}_bias"]["w"] if f"{b}.{p}_bias" in views else None  # noqa: E731
    return ExpertWeights(*(store_linear(store, f"{b}.{p}", views[f"{b}.{p}"], bias(p)) for p in ("gate_up", "down")))


def head_part_from_views(store: WeightStore, group: str, views: dict) -> HeadPart:
    norm = views.get("out_norm", {}).get("w")
    return HeadPart(store.head_rows(group)[0], store_linear(store, group, views[group]), norm)


def group_from_views(store: WeightStore, group: str, views: dict):
    """The weights of one store group ("layer.7", "expert.7.12" or "head.2") from views of its bytes."""
    if group.startswith("head."):
        return head_part_from_views(store, group, views)
    if group.startswith("expert."):
        return expert_from_views(store, group, views)
    return layer_from_views(store, int(group.split(".")[1]), views)


class HeldWeights:
    """Weights all held in memory (`layers`, `expert` by (layer, expert), `head` parts): a forward's requests
    answered from them (models/requests.py `weights_for`)."""

    layers: list[LayerWeights]
    expert: dict[tuple[int, int], ExpertWeights]
    head: list[HeadPart]

    def layer(self, i: int) -> LayerWeights:
        return self.layers[i]

    def experts(self, need) -> dict[int, ExpertWeights]:
        """`need`: a `models.requests.NeedExperts`."""
        return {e: self.expert[need.layer, e] for e in need.experts}

    def head_part(self, j: int) -> HeadPart:
        return self.head[j]


class ResidentWeights(HeldWeights):
    """Every layer and head part in RAM: the weights file read into one buffer, arrays viewed out of it.
    On the CPU the embedding table stays on disk (`EmbeddingRows`): a forward needs a few of its rows; so does
    a table of per-layer embeddings (`ple`, Gemma 4)."""

    def __init__(self, store: WeightStore, device: str = "cpu"):
        self.store = store
        self.args: ModelArgs = store.args
        first = min((g.offset for n, g in store.groups.items() if n != "embed"), default=0) if device == "cpu" else 0
        buf = store.read_all(first, huge=device == "cpu")
        if device != "cpu":
            buf = buf.to(device)

        def group(name):
            g = store.groups[name]
            return store.views(name, buf[g.offset - first : g.offset - first + g.nbytes])

        self.buffer = buf
        self.embed = EmbeddingRows(store) if device == "cpu" else group("embed")["embed"]["w"]
        pl = "embed_pl" in store.tensors  # per-layer embeddings (Gemma 4): on the CPU from disk, the rows needed
        self.ple = (
            (EmbeddingRows(store, "embed_pl") if device == "cpu" else group("embed")["embed_pl"]["w"]) if pl else None
        )
        self.layers = [layer_from_views(store, i, group(f"layer.{i}")) for i in range(self.args.n_layers)]
        self.expert = {
            (i, e): expert_from_views(store, expert_group(i, e), group(expert_group(i, e)))
            for i in range(self.args.n_layers)
            for e in range(self.args.n_experts)
            if self.args.experts_at(i)
        }
        self.head_groups = store.head_groups()
        self.head = [head_part_from_views(store, g, group(g)) for g in self.head_groups]

    def nbytes(self) -> int:
        return self.buffer.numel()


class TensorWeights(HeldWeights):
    """Weights from float tensors in memory, by canonical name (tests, tiny models), in any format."""

    def __init__(self, args: ModelArgs, tensors: dict[str, torch.Tensor], fmt: str = "fp32", group_size: int = 32):
        from formats.convert import linear_format

        self.args = args

        def enc(name, bias=None):
            if name not in tensors:
                return None
            f = linear_format(name, fmt)
            return linear.decode(f, *linear.encode(tensors[name], f, group_size), bias)

        norm = lambda name: tensors[name].float() if name in tensors else None
        self.embed = tensors["embed"].to(linear.float_dtype(fmt))
        self.ple = tensors["embed_pl"].to(linear.float_dtype(fmt)) if "embed_pl" in tensors else None
        self.layers = [layer_weights(i, enc, norm) for i in range(args.n_layers)]
        self.expert = {
            (i, e): ExpertWeights(
                *(enc(f"blk.{i}.exp.{e}.{p}", tensors.get(f"blk.{i}.exp.{e}.{p}_bias")) for p in ("gate_up", "down"))
            )
            for i in range(args.n_layers)
            for e in range(args.n_experts)
            if args.experts_at(i)
        }
        head = tensors.get("head", tensors["embed"] if args.tied_embeddings else None)
        self.head_groups = ["head.0"]
        hf = linear_format("head", fmt)
        self.head = [HeadPart(0, linear.decode(hf, *linear.encode(head, hf, group_size)), tensors["out_norm"].float())]


def random_tensors(args: ModelArgs, seed: int = 0, scale: float = 0.5) -> dict[str, torch.Tensor]:
    """Random float weights of a model shape: a tiny model for tests, no files involved."""
    from models.shapes import tensor_shape
    from formats.source import canonical_names

    g = torch.Generator().manual_seed(seed)
    out = {}
    for _, name in canonical_names(args):
        shape = tensor_shape(args, name)
        if name.endswith("norm"):
            out[name] = 1.0 + 0.1 * torch.randn(shape, generator=g)
        else:
            fan_in = shape[-1] if len(shape) > 1 else 1
            out[name] = torch.randn(shape, generator=g) * (scale / fan_in**0.5 if len(shape) > 1 else 0.1)
    return out


class StreamingWeights:
    """Some groups resident (read once), the others handed in as views of arena slots per forward.

    `layer(i)` / `head_part(j)` give the resident ones; `from_buffer(group, buf)` maps a streamed
    group that the loader put into a slot, with no copy. The embedding stays on disk (`EmbeddingRows`).
    """

    def __init__(self, store: WeightStore, resident: set[str], head_rows: int | None = None):
        """`head_rows`: keep only the output head's rows below that token id (FR-Spec: a draft that
        proposes only the frequent tokens, for a fraction of the head's memory); the parts above it
        are left out and their logits are -inf."""
        self.store, self.args = store, store.args
        self.head_rows = head_rows  # the width of the logits a forward gives (models/transformer.py)
        self.resident_groups = set(resident)
        self.head_groups = store.head_groups()
        self.embed = EmbeddingRows(store)
        self.ple = EmbeddingRows(store, "embed_pl") if "embed_pl" in store.tensors else None
        self.layers: dict[int, LayerWeights] = {}
        self.expert: dict[tuple[int, int], ExpertWeights] = {}
        self.head: dict[int, HeadPart | None] = {}
        self.buffers = {}
        with open(store.path, "rb", buffering=0) as f:
            for name in sorted(set(resident) - {"embed"}, key=lambda g: store.groups[g].offset):
                if head_rows is not None and name.startswith("head."):
                    self.head[int(name.split(".")[1])] = _read_head_rows(store, name, f, head_rows, self.buffers)
                    continue
                g = store.groups[name]
                buf = weights_buffer(g.nbytes)
                f.seek(g.offset)
                f.readinto(memoryview(buf.numpy()))
                self.buffers[name] = buf
                self._install(name, buf)

    def _install(self, name: str, buf: torch.Tensor):
        w = self.from_buffer(name, buf)
        if name.startswith("head."):
            self.head[int(name.split(".")[1])] = w
        elif name.startswith("expert."):
            _, i, e = name.split(".")
            self.expert[int(i), int(e)] = w
        else:
            self.layers[int(name.split(".")[1])] = w

    def from_buffer(self, name: str, buf: torch.Tensor):
        return group_from_views(self.store, name, self.store.views(name, buf))

    def layer(self, i: int) -> LayerWeights:
        return self.layers[i]

    def head_part(self, j: int) -> HeadPart | None:
        return self.head[j]

    def experts(self, need) -> dict[int, ExpertWeights]:
        return {e: self.expert[need.layer, e] for e in need.experts}

    def is_resident(self, need) -> bool:
        """`need`: a `models.requests.NeedWeights` or `NeedExperts`."""
        from models.requests import NeedExperts

        if isinstance(need, NeedExperts):
            return all((need.layer, e) in self.expert for e in need.experts)
        return need.index in (self.head if need.head else self.layers)

    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers.values())


def _read_head_rows(store: WeightStore, group: str, f, rows: int, buffers: dict) -> HeadPart | None:
    """A head part's rows below token `rows` (None if it has none), read array by array."""
    from formats.store import DTYPES

    lo, hi = store.head_rows(group)
    if rows <= lo:
        return None
    views: dict[str, dict[str, torch.Tensor]] = {}
    for name, key, a, nbytes in store.head_arrays(group, rows):
        buf = weights_buffer(nbytes)
        f.seek(a["offset"])
        f.readinto(memoryview(buf.numpy()))
        buffers[f"{group}:{name}.{key}"] = buf
        shape = [nbytes // (a["nbytes"] // a["shape"][0]), *a["shape"][1:]] if nbytes != a["nbytes"] else a["shape"]
        views.setdefault(name, {})[key] = buf.view(DTYPES[a["dtype"]]).view(shape)
    part = head_part_from_views(store, group, views)
    keep = min(hi, rows) - lo
    if part.out.n != keep:  # the last whole tile read holds rows past `rows`
        part.out = part.out.rows(0, keep)
    return part
