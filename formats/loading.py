"""Loading a model for generation: its weight store, tokenizer and transformer, every layer resident.

Generation itself, the target alone included, is the speculation cycle (speculative/generate.py)."""

from __future__ import annotations

from dataclasses import dataclass

from formats.convert import ensure_store
from formats.store import WeightStore
from text.tokenizer import TextTokenizer
from models.transformer import Transformer
from formats.weights import ResidentWeights, StreamingWeights


@dataclass
class LoadedModel:
    name: str
    store: WeightStore
    tokenizer: TextTokenizer
    model: Transformer

    @property
    def args(self):
        return self.store.args


def load(model: str, fmt: str = "bf16", device: str = "cpu", group_size: int = 32) -> LoadedModel:
    return load_store(ensure_store(model, fmt, group_size), model, device)


def load_store(
    store: WeightStore | str, name: str = "", device: str = "cpu", head_rows: int | None = None, tokenizer: bool = True
) -> LoadedModel:
    """A model from a weight store, every layer resident. `head_rows` (a draft, on the CPU): its output head
    keeps only the rows of the tokens below that id (FR-Spec: the frequent ones), for a cheaper forward.
    `tokenizer` False: none loaded (an actor that sees token ids only; the tokenizer's tables are tens of MB)."""
    if not isinstance(store, WeightStore):
        store = WeightStore(store)
    if head_rows and device == "cpu":
        weights = StreamingWeights(store, set(store.group_names()) - {"embed"}, head_rows)
    else:
        weights = ResidentWeights(store, device)
    return LoadedModel(
        name or store.dir.name,
        store,
        TextTokenizer(store.tokenizer_info) if tokenizer else None,
        Transformer(store.args, weights, device),
    )
