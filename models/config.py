"""ModelArgs: the shape of a Llama/Qwen2-family transformer."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from cadence.errors import CadenceError

ARCHS = ("llama", "qwen2")


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
        if self.head_dim % 2:
            raise CadenceError(f"head_dim={self.head_dim} must be even for rotary embeddings")

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

    def n_params(self) -> int:
        per_layer = self.dim * (self.q_dim + 2 * self.kv_dim) + self.q_dim * self.dim + 3 * self.dim * self.ffn_dim
        head = 0 if self.tied_embeddings else self.vocab_size * self.dim
        return self.vocab_size * self.dim + self.n_layers * per_layer + head

    def kv_bytes_per_token(self, itemsize: int = 4) -> int:
        return 2 * self.n_layers * self.kv_dim * itemsize
