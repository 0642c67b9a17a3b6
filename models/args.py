"""ModelArgs: the shape of a decoder, dense or mixture-of-experts, and what its family changes in the block.

One block serves every family (models/transformer.py); a family is the values of a few fields here, read from
its config by models/families/: where the norms stand (`pre_norm`, `post_norm`: Gemma 2/3 both, OLMo 2 after
only), the FFN's activation (SwiGLU, or Gemma's GeGLU with tanh gelu), scales (embeddings, attention,
residual branches, logits: Gemma, Granite), soft caps (Gemma 2), q/k norms (per head: Qwen 3, Gemma 3; over the
whole projection: OLMo 2, OLMoE), rotary scaling (models/rope.py), and sliding-window layers with their own
rope base (Gemma 2/3, Mistral v0.1, Qwen 2).

A mixture of experts (qwen2_moe with a shared expert, qwen3_moe, olmoe, mixtral) routes each token to
`n_experts_used` of `n_experts` SwiGLU experts of width `expert_ffn_dim` by a softmax over the router's
logits, the top-k weights renormalised to sum to one where the model says so (`norm_topk`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from common.errors import CadenceError
from models.rope_scaling import RopeScaling
from models.shapes import Shapes

ARCHS = (
    "llama",
    "mistral",
    "granite",
    "qwen2",
    "qwen3",
    "gemma2",
    "gemma3",
    "phi3",
    "olmo2",
    "qwen2_moe",
    "qwen3_moe",
    "olmoe",
    "mixtral",
    "smollm3",
    "olmo3",
    "seed_oss",
    "exaone4",
    "glm4",
    "ministral3",
    "lfm2",
    "qwen3_5",
    "granitehybrid",
    "nemotron_h",
    "gpt_oss",
    "qwen3_5_moe",
    "lfm2_moe",
    "glm4_moe",
    "qwen3_next",
    "olmo_hybrid",
    "llama4",
    "falcon_h1",
    "mistral4",
    "gemma4",
)
# none; RMSNorm per head over head_dim (qwen3); over the whole q / k projection (olmoe); a weightless RMSNorm per
# head after RoPE, on the rotating layers (Llama 4's L2 norm)
QK_NORMS = ("", "head", "full", "l2")
ACTS = ("silu", "gelu_tanh", "relu2")  # relu2: a non-gated FFN, relu(x W_up)^2 (Nemotron-H)


@dataclass(frozen=True)
class ModelArgs(Shapes):
    arch: str
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    norm_eps: float
    rope_base: float
    context_length: int
    qkv_bias: bool
    tied_embeddings: bool
    head_dim: int = 0  # 0: dim // n_heads
    qk_norm: str = ""
    n_experts: int = 0  # 0: a dense model
    n_experts_used: int = 0
    expert_ffn_dim: int = 0
    shared_ffn_dim: int = 0  # qwen2_moe: the shared expert's width (0: none)
    norm_topk: bool = False
    # the block: which norms, which activation, which scales (1.0 / 0.0: none)
    pre_norm: bool = True  # RMSNorm before attention and before the FFN (all but OLMo 2)
    post_norm: bool = False  # RMSNorm of each branch's output before the residual add (Gemma 2/3, OLMo 2)
    act: str = "silu"  # the FFN's gate: SwiGLU, or GeGLU with tanh gelu (Gemma)
    embed_scale: float = 1.0  # embeddings times this (Gemma: sqrt(dim); Granite: embedding_multiplier)
    attn_scale: float = 0.0  # softmax scale of q.k (0: head_dim ** -0.5)
    residual_scale: float = 1.0  # each branch times this before the residual add (Granite)
    attn_softcap: float = 0.0  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_softcap: float = 0.0  # the same on the logits
    logits_div: float = 1.0  # logits divided by this (Granite: logits_scaling)
    # rotary embeddings and sliding windows
    rope_scaling: RopeScaling | None = None  # of the full-attention layers
    rope_dim: int = 0  # rotated dims of a head (0: all); a partial rotary's are moved to the front halves
    rope_local_base: float = 0.0  # the sliding layers' rope base, unscaled (Gemma 3; 0: as the others)
    sliding_window: int = 0  # keys a sliding layer's query sees, itself included
    sliding_layers: tuple[int, ...] = ()
    nope_layers: tuple[int, ...] = ()  # layers without rotary embeddings (SmolLM3, EXAONE 4's global ones)
    # queries scaled by position after RoPE (Ministral 3, Llama 4): q *= 1 + beta * ln(1 + floor((pos + offset) / scale))
    attn_temp_beta: float = 0.0
    attn_temp_scale: float = 1.0
    attn_temp_offset: int = 0
    attn_temp_layers: tuple[int, ...] = ()  # the layers whose queries are so scaled (empty: every layer)
    # chunked attention (Llama 4's rotating layers): a query sees the keys of its own chunk of `chunk_size` positions
    chunk_size: int = 0
    chunk_layers: tuple[int, ...] = ()
    # short-convolution layers in place of attention (LFM2): a depthwise causal convolution of `conv_kernel` taps
    conv_layers: tuple[int, ...] = ()
    conv_kernel: int = 0
    # gated delta-net layers in place of attention (Qwen 3.5, Qwen3-Next): a short convolution over q/k/v, then a
    # recurrent state [v heads, k dim, v dim] per layer (models/recurrent.py)
    gdn_layers: tuple[int, ...] = ()
    gdn_k_heads: int = 0
    gdn_v_heads: int = 0
    gdn_k_dim: int = 0
    gdn_v_dim: int = 0
    attn_gate: bool = False  # the attention's output times sigmoid of a gate projection (Qwen 3.5, Qwen3-Next)
    # Mamba-2 layers in place of attention (Granite 4.0-H): a short convolution over x, B and C (with a bias), then a
    # state [heads, head dim, state size] per layer
    ssm_layers: tuple[int, ...] = ()
    ssm_heads: int = 0
    ssm_head_dim: int = 0
    ssm_state: int = 0
    ssm_groups: int = 1
    ssm_conv_bias: bool = True
    # the gated output: "gated" norm(y * silu(z)) in groups (Granite), "before" norm(y) * silu(z), "none" y * silu(z)
    ssm_norm: str = "gated"
    # multi-head latent attention (Mistral 4, models/mla.py): the latent's width (0: none) and the queries' (0: none)
    mla_kv_rank: int = 0
    mla_q_rank: int = 0
    parallel_mixers: bool = False  # Falcon-H1: a recurrent layer attends too, both mixers on the layer's one input
    # layers of one part only (Nemotron-H: a layer is a mixer or an FFN): no attention or recurrent mixer, no FFN
    no_mixer_layers: tuple[int, ...] = ()
    no_ffn_layers: tuple[int, ...] = ()
    # gpt-oss: a learned logit per head in every softmax's denominator (attention sinks), a bias on the attention's
    # output; a router with a bias whose top k logits are softmaxed, experts with biases and a clamped SwiGLU,
    # (up + 1) * gate * sigmoid(alpha * gate) with gate <= limit and |up| <= limit
    attn_sinks: bool = False
    attn_out_bias: bool = False
    router_bias: bool = False
    router_topk_first: bool = False
    expert_bias: bool = False
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 1.0
    # a mixture of experts' other routers (LFM2-MoE, GLM-4.5): sigmoid scores, a bias that only chooses the top k,
    # the chosen renormalised (+ eps) and scaled; its first layers dense
    dense_layers: tuple[int, ...] = ()
    router_sigmoid: bool = False
    router_select_bias: bool = False
    routed_scale: float = 1.0
    norm_topk_eps: float = 0.0
    pre_only_layers: tuple[int, ...] = ()  # pre-norms, no post-norms, in a post-norm model (OLMo-hybrid's delta-nets)
    gdn_beta_scale: float = 1.0  # beta = scale * sigmoid(b) (OLMo-hybrid: 2, negative eigenvalues allowed)
    gdn_norm_eps: float = 0.0  # the delta-net output norm's epsilon (0: the model's)
    router_scales_input: bool = False  # Llama 4: the routing weight scales the expert's input, not its output
    shared_gated: bool = True  # the shared expert's output times sigmoid of its gate (Qwen2-MoE), else as it is
    # Gemma 4: full-attention layers with heads of their own size and count (0: the sliding layers'), each value
    # head normed (weightless), the last `kv_shared` layers attending over the keys and values the last earlier
    # layer of their kind made (no cache of their own), each layer's output times a scalar of its own, and
    # per-layer embeddings (`ple_dim` per layer from a table of `ple_vocab` rows, read from disk row by row)
    full_head_dim: int = 0
    full_kv_heads: int = 0
    v_norm: bool = False
    kv_shared: int = 0
    layer_scale: bool = False
    ple_dim: int = 0
    ple_vocab: int = 0
    k_eq_v: bool = False  # full layers' values are their raw keys (read as value rows equal to the key rows)
    experts_beside_dense: bool = False  # Gemma 4's 26B: the experts beside the dense MLP (models/moe.py `beside_dense`)
    wide_shared_ffn: bool = False  # the KV-sharing layers' FFN twice as wide (Gemma 4's use_double_wide_mlp)

    def __post_init__(self):
        if self.arch not in ARCHS:
            raise CadenceError(f"model architecture '{self.arch}' is not supported; cadence runs {', '.join(ARCHS)}")
        for field in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "context_length"):
            if getattr(self, field) <= 0:
                raise CadenceError(f"model config field {field}={getattr(self, field)} must be positive")
        if self.n_heads % self.n_kv_heads:
            raise CadenceError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim == 0:
            if self.dim % self.n_heads:
                raise CadenceError(f"dim={self.dim} is not a multiple of n_heads={self.n_heads}")
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        if self.qk_norm not in QK_NORMS:
            raise CadenceError(f"qk_norm={self.qk_norm!r} is not one of {QK_NORMS}")
        if self.n_experts and not (0 < self.n_experts_used <= self.n_experts and self.expert_ffn_dim > 0):
            raise CadenceError(
                f"a mixture of experts needs 0 < experts used ({self.n_experts_used}) <= experts "
                f"({self.n_experts}) and an expert width > 0 ({self.expert_ffn_dim})"
            )
        if self.head_dim % 2:
            raise CadenceError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.act not in ACTS:
            raise CadenceError(f"activation {self.act!r} is not one of {ACTS}")
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", RopeScaling.from_dict(self.rope_scaling))
        object.__setattr__(self, "sliding_layers", tuple(sorted(int(i) for i in self.sliding_layers)))
        if self.sliding_layers and not (0 < self.sliding_window and 0 <= self.sliding_layers[0]):
            raise CadenceError(f"sliding layers {self.sliding_layers} need a window > 0 (got {self.sliding_window})")
        object.__setattr__(self, "nope_layers", tuple(sorted(int(i) for i in self.nope_layers)))
        if self.nope_layers and self.nope_layers[-1] >= self.n_layers:
            raise CadenceError(f"layer {self.nope_layers[-1]} without rope is past the model's {self.n_layers} layers")
        object.__setattr__(self, "conv_layers", tuple(sorted(int(i) for i in self.conv_layers)))
        if self.conv_layers and not (self.conv_kernel > 1 and self.conv_layers[-1] < self.n_layers):
            raise CadenceError(
                f"conv layers {self.conv_layers} need a kernel > 1 (got {self.conv_kernel}) and a layer each"
            )
        object.__setattr__(self, "gdn_layers", tuple(sorted(int(i) for i in self.gdn_layers)))
        if self.gdn_layers and not (
            self.conv_kernel > 1
            and self.gdn_layers[-1] < self.n_layers
            and min(self.gdn_k_heads, self.gdn_k_dim, self.gdn_v_dim) > 0
            and self.gdn_v_heads % self.gdn_k_heads == 0
        ):
            raise CadenceError(
                f"gated delta-net layers need a kernel > 1, key heads dividing value heads and sizes > 0 (kernel "
                f"{self.conv_kernel}, heads {self.gdn_k_heads}/{self.gdn_v_heads}, dims {self.gdn_k_dim}/{self.gdn_v_dim})"
            )
        object.__setattr__(self, "ssm_layers", tuple(sorted(int(i) for i in self.ssm_layers)))
        if self.ssm_layers and not (
            self.conv_kernel > 1
            and self.ssm_layers[-1] < self.n_layers
            and min(self.ssm_heads, self.ssm_head_dim, self.ssm_state, self.ssm_groups) > 0
            and self.ssm_heads % self.ssm_groups == 0
        ):
            raise CadenceError(
                f"Mamba-2 layers need a kernel > 1, groups dividing heads and sizes > 0 (kernel {self.conv_kernel}, "
                f"heads {self.ssm_heads}, groups {self.ssm_groups}, head dim {self.ssm_head_dim}, state {self.ssm_state})"
            )
        for name in ("no_mixer_layers", "no_ffn_layers"):
            object.__setattr__(self, name, tuple(sorted(int(i) for i in getattr(self, name))))
        if set(self.no_mixer_layers) & set(self.rec_layers + self.sliding_layers):
            raise CadenceError("a layer without a mixer cannot be a recurrent or sliding-window layer")
        if sum(map(bool, (self.conv_layers, self.gdn_layers, self.ssm_layers))) > 1:
            raise CadenceError("a model has one kind of recurrent layer: convolutions, gated delta-nets or Mamba-2")
        if self.mla_kv_rank and (self.n_kv_heads != self.n_heads or not 0 < self.rope_dim < self.head_dim):
            raise CadenceError("latent attention needs a key head per query head and a rotary part of each head")
        if self.ssm_norm not in ("gated", "before", "none"):
            raise CadenceError(f"ssm_norm={self.ssm_norm!r} is not one of gated, before, none")
        if set(self.rec_layers) & set(self.sliding_layers):
            raise CadenceError("a layer cannot be both a recurrent and a sliding-window attention layer")
        if self.attn_temp_beta and self.attn_temp_scale <= 0:
            raise CadenceError(f"attn_temp_scale={self.attn_temp_scale} must be positive")
        if self.sliding_layers and self.sliding_layers[-1] >= self.n_layers:
            raise CadenceError(f"sliding layer {self.sliding_layers[-1]} is past the model's {self.n_layers} layers")
        if not 0 <= self.rope_dim <= self.head_dim or self.rope_dim % 2:
            raise CadenceError(f"rope_dim={self.rope_dim} must be even and at most head_dim={self.head_dim}")
        self._check_shared()

    def _check_shared(self):
        """Gemma 4's fields: full layers' heads of their own only where sliding layers rotate with tables of their
        own (the tables' width is the head's), and a layer of each kind before the ones that share."""
        if (self.full_head_dim or self.full_kv_heads) and not (self.sliding_layers and self.rope_local_base > 0):
            raise CadenceError(
                "full-attention heads of their own size need sliding layers with a rope base of their own"
            )
        if self.full_head_dim % 2 or (self.full_kv_heads and self.n_heads % self.full_kv_heads):
            raise CadenceError(f"full_head_dim={self.full_head_dim} must be even, full_kv_heads divide n_heads")
        if self.ple_dim and self.moe:
            raise CadenceError("per-layer embeddings beside a mixture of experts are in no model cadence knows")
        if not 0 <= self.kv_shared < self.n_layers:
            raise CadenceError(f"kv_shared={self.kv_shared} must be below the model's {self.n_layers} layers")
        for i in range(self.n_layers - self.kv_shared, self.n_layers):
            if self.kv_source(i) is None:
                raise CadenceError(f"layer {i} shares the keys and values of an earlier layer of its kind; none is")

    @property
    def moe(self) -> bool:
        return self.n_experts > 0

    @property
    def scale(self) -> float:
        """The softmax scale of q.k."""
        return self.attn_scale or self.head_dim**-0.5

    def sliding(self, layer: int) -> bool:
        return layer in self.sliding_layers

    def conv(self, layer: int) -> bool:
        return layer in self.conv_layers

    @property
    def rec_layers(self) -> tuple[int, ...]:
        """The layers with a recurrent state instead of a KV cache (convolutions, gated delta-nets)."""
        return self.conv_layers or self.gdn_layers or self.ssm_layers

    @property
    def rec_kind(self) -> str:
        return "conv" if self.conv_layers else "gdn" if self.gdn_layers else "ssm" if self.ssm_layers else ""

    @property
    def ssm_inner(self) -> int:
        return self.ssm_heads * self.ssm_head_dim

    @property
    def ssm_conv_dim(self) -> int:
        """Channels a Mamba-2 layer convolves: x (heads x head dim), B and C (groups x state size each)."""
        return self.ssm_inner + 2 * self.ssm_groups * self.ssm_state

    def recurrent(self, layer: int) -> bool:
        return layer in self.rec_layers

    def attends(self, layer: int) -> bool:
        """The layer has an attention mixer (a recurrent layer too where the mixers run side by side: Falcon-H1)."""
        return self.mixes(layer) and (self.parallel_mixers or layer not in self.rec_layers)

    @property
    def n_full(self) -> int:
        """Layers attending over the whole context (a KV cache row per token)."""
        return sum(self.attends(i) and not self.sliding(i) and not self.shares_kv(i) for i in range(self.n_layers))

    def mixes(self, layer: int) -> bool:
        """The layer has a mixer (attention or recurrent)."""
        return layer not in self.no_mixer_layers

    def pre(self, layer: int) -> bool:
        """The layer has norms before its branches."""
        return self.pre_norm or layer in self.pre_only_layers

    def post(self, layer: int) -> bool:
        """The layer has norms on its branches' outputs."""
        return self.post_norm and layer not in self.pre_only_layers

    def has_ffn(self, layer: int) -> bool:
        return layer not in self.no_ffn_layers

    def experts_at(self, layer: int) -> bool:
        """The layer's FFN is a mixture of experts (not a dense layer of a mixture's model)."""
        return self.moe and layer not in self.dense_layers

    def plain_block(self) -> bool:
        """Llama's block: norms before each branch only, SwiGLU, no scales, caps or sliding windows. The sparse
        worker's splits take these; the others run through the separate calls."""
        return (
            self.pre_norm
            and not (self.post_norm or self.nope_layers or self.attn_temp_beta or self.rec_layers or self.attn_gate)
            and not (self.no_mixer_layers or self.no_ffn_layers or self.attn_sinks or self.attn_out_bias)
            and not (self.mla_kv_rank or self.attn_softcap or self.sliding_layers or self.v_norm or self.layer_end)
            and self.act == "silu"
            and self.residual_scale == 1.0
        )

    def rope_kind(self, layer: int) -> str:
        """Which rotary tables a layer takes: "none" (NoPE), "local" (a sliding layer's own base, unscaled) or
        "full"."""
        if layer in self.nope_layers:
            return "none"
        return "local" if self.sliding(layer) and self.rope_local_base > 0 else "full"

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelArgs":
        return cls(**d)

    def ffn_params(self) -> int:
        """Weights of one layer's feed-forward part that every token uses (the router and the shared expert of an MoE)."""
        if not self.moe:
            return 3 * self.dim * self.ffn_dim
        return self.n_experts * self.dim + 3 * self.dim * self.shared_ffn_dim + (self.dim if self.shared_ffn_dim else 0)

    def expert_params(self) -> int:
        """Weights of one expert (gate, up and down)."""
        return 3 * self.dim * self.expert_ffn_dim

    def layer_params(self) -> int:
        """Weights of one layer that every token uses (all of a dense layer; an MoE layer without its experts)."""
        return self.dim * (self.q_dim + 2 * self.kv_dim) + self.q_dim * self.dim + self.ffn_params()
