"""`--draft flash`: the target as its own draft, its FFN sparse (LLM in a flash, §5.2's pairing with
speculative decoding): attention, norms, the output head and the embedding are the resident target's own
tensors (shared, not copied), each layer's FFN computes only the neurons the predictor picks, from a neuron
cache filled from the bundles. The dense target verifies every proposal, so the output is exactly the
target's; the draft costs its predictor and its caches."""

from __future__ import annotations

import torch

from flash.predictor import Predictor
from flash.weights import FlashFFN, FlashWeights
from formats.store import WeightStore
from models.transformer import Transformer
from formats.weights import LayerWeights


def with_ffn(t: LayerWeights, ffn) -> LayerWeights:
    """Layer `t`'s attention and norms (its own tensors, not copies), its FFN the callable `ffn(h, x)` (adds into x)."""
    return LayerWeights(
        attn_norm=t.attn_norm,
        qkv=t.qkv,
        attn_out=t.attn_out,
        ffn_norm=t.ffn_norm,
        q_norm=t.q_norm,
        k_norm=t.k_norm,
        flash=ffn,
    )


class SharedFlashWeights(FlashWeights):
    """FlashWeights over a resident target's weights (`ResidentWeights`): the prompt's pass takes the target's
    dense FFN from memory, a draft step the predicted neurons; every cache may hold all of its layer."""

    def __init__(self, target, store: WeightStore, predictor: Predictor, density: float):
        self.target = target
        super().__init__(store, predictor, density)
        self.allocate(store.args.ffn_dim)

    def _load_resident(self) -> None:
        self.resident, self.embed, self.ple = (
            self.target,
            self.target.embed,
            self.target.ple,
        )  # the head and embedding: the target's
        self.layers += [with_ffn(self.target.layer(i), FlashFFN(self, i, None)) for i in range(self.args.n_layers)]

    def dense_ffn(self, i: int):
        t = self.target.layer(i)
        return t.gate_up, t.down

    def nbytes(self) -> int:
        """What the draft adds to the target: the predictor and the caches."""
        return self.predictor.nbytes + sum(w.flash.cache.nbytes for w in self.layers if w.flash.cache is not None)

    def close(self) -> None:
        self.reader.close()  # the rest is the target's


def flash_draft(target: Transformer, store: WeightStore, density: float) -> Transformer:
    """The draft model of `--draft flash` for a resident target model."""
    weights = SharedFlashWeights(target.weights, store, Predictor.load(store, dtype=torch.bfloat16), density)
    return Transformer(store.args, weights, target.device)


def streamed_flash_draft(
    store: WeightStore, density: float, predictor: str, capacity: int, head_rows: int | None
) -> Transformer:
    """The draft of `--draft flash` in the draft actor, beside a target that streams: every layer's attention and
    the output head (its `head_rows` most frequent tokens) held here, the predictor named `predictor`, each layer's FFN
    from a neuron cache of `capacity` neurons filled from the bundles; the prompt's pass reads the dense FFNs
    (`FlashWeights`). flash/footprint.py `draft_bytes` says what it holds."""
    weights = FlashWeights(store, Predictor.load(store, predictor, dtype=torch.bfloat16), density, head_rows)
    weights.allocate(capacity)
    return Transformer(store.args, weights)
