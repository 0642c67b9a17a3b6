"""ModelArgs: the shape of a decoder of the Llama / Qwen family, dense or mixture-of-experts.

Dense: llama, qwen2, qwen3 (q/k norms per head). Mixture-of-experts: qwen2_moe (a shared expert
with its own sigmoid gate), qwen3_moe (q/k norms per head), olmoe (q/k norms over the whole
projection), mixtral. Every MoE layer routes each token to `n_experts_used` of `n_experts`
SwiGLU experts of width `expert_ffn_dim` by a softmax over the router's logits, the top-k
weights renormalised to sum to one where the model says so (`norm_topk`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from common.errors import CadenceError

ARCHS = ("llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "olmoe", "mixtral")
QK_NORMS = ("", "head", "full")  # none; RMSNorm per head over head_dim (qwen3); over the whole q / k projection (olmoe)


@dataclass(frozen=True)
class ModelArgs:
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

    @property
    def moe(self) -> bool:
        return self.n_experts > 0

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

    def kv_bytes_per_token(self, itemsize: int = 4) -> int:
        return 2 * self.n_layers * self.kv_dim * itemsize
