"""RopeScaling: how a model stretches its rotary embeddings past the context it was trained on (linear, dynamic
NTK, YaRN, LongRoPE, Llama 3's, or a GGUF's per-frequency divisors) or rotates part of a head (Gemma 4's
proportional), in both spellings configs use; models/rope.py
builds the tables from it."""

from __future__ import annotations

from dataclasses import dataclass, fields

from common.errors import CadenceError

ROPE_KINDS = ("linear", "dynamic", "yarn", "longrope", "llama3", "divisors", "proportional")


@dataclass(frozen=True)
class RopeScaling:
    kind: str
    factor: float = 1.0
    original_context: int = 0  # the pretraining context (llama3, yarn, longrope); dynamic: max_position_embeddings
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0
    truncate: bool = True
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float = 0.0  # yarn, longrope: cos and sin scaled by it (0: derived from the factor)
    short_factor: tuple[float, ...] = ()  # longrope, one per frequency
    long_factor: tuple[float, ...] = ()
    divisors: tuple[float, ...] = ()  # a GGUF's rope_freqs: each frequency divided by its own
    # proportional (Gemma 4's full layers): the first `proportion` of a head's rotate-half pairs rotate, at the
    # frequencies of the whole head; the rest do not
    proportion: float = 1.0

    def __post_init__(self):
        if self.kind not in ROPE_KINDS:
            raise CadenceError(f"rope scaling '{self.kind}' is not supported; cadence runs {', '.join(ROPE_KINDS)}")
        for name in ("short_factor", "long_factor", "divisors"):
            object.__setattr__(self, name, tuple(float(x) for x in getattr(self, name)))

    @classmethod
    def from_dict(cls, d: dict | None) -> "RopeScaling | None":
        if d is None:
            return None
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})
