"""Loading a model for generation, and generation with the target model alone (the reference)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from cadence.errors import CadenceError
from cadence.settings import Generation  # noqa: F401  (torch-free, re-exported)
from models.convert import ensure_store
from models.sampling import Sampler, SamplingConfig
from models.store import WeightStore
from models.tokenizer import TextTokenizer
from models.transformer import KVCache, Transformer
from models.weights import ResidentWeights

PREFILL_CHUNK = 256


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


def load_store(store: WeightStore | str, name: str = "", device: str = "cpu") -> LoadedModel:
    """A model from a weight store, every layer resident."""
    if not isinstance(store, WeightStore):
        store = WeightStore(store)
    weights = ResidentWeights(store, device)
    return LoadedModel(name or store.dir.name, store, TextTokenizer(store.tokenizer_info), Transformer(store.args, weights, device))


def check_length(model: Transformer, n_prompt: int, max_new: int, slack: int = 0) -> int:
    """Cache capacity for a prompt and its continuation, or a clear error if the context is too short."""
    if n_prompt == 0:
        raise CadenceError("the prompt is empty after tokenization; give some text")
    need = n_prompt + max_new + slack
    ctx = model.args.context_length
    if n_prompt + max_new > ctx:
        raise CadenceError(f"the prompt has {n_prompt} tokens and {max_new} new tokens were asked for, "
                           f"but the model's context holds {ctx}; shorten the prompt or lower --max-new-tokens")
    return min(need, ctx)


def prefill(model: Transformer, cache: KVCache, ids: list[int]) -> torch.Tensor:
    """Run the prompt through the model in chunks; returns the logits of its last token [V]."""
    logits = None
    for s in range(0, len(ids), PREFILL_CHUNK):
        chunk = torch.tensor(ids[s:s + PREFILL_CHUNK], device=model.device)
        pos = torch.arange(cache.length, cache.length + len(chunk), device=model.device)
        logits = model.forward(chunk, pos, cache, logits_rows=slice(-1, None))[0]
        cache.commit()
    return logits


def generate_target(lm: LoadedModel, prompt_ids: list[int], max_new: int, sampling: SamplingConfig,
                    on_tokens: Callable[[list[int]], None] | None = None, stop_at_eos: bool = True) -> Generation:
    """Decode one token at a time with the target model: the output every other mode must equal."""
    model = lm.model
    cache = model.new_cache(check_length(model, len(prompt_ids), max_new))
    sampler = Sampler(sampling)
    stop = lm.tokenizer.stop_ids if stop_at_eos else set()
    t0 = time.perf_counter()
    logits = prefill(model, cache, prompt_ids)
    t_prefill = time.perf_counter() - t0
    out: list[int] = []
    while len(out) < max_new:
        tok = sampler(logits)
        out.append(tok)
        if on_tokens:
            on_tokens([tok])
        if tok in stop or len(out) == max_new:
            break
        pos = torch.tensor([cache.length], device=model.device)
        logits = model.forward(torch.tensor([tok], device=model.device), pos, cache)[0]
        cache.commit()
    return Generation(prompt_ids, out, time.perf_counter() - t0, t_prefill, {"target_forwards": len(out)})
