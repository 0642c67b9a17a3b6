"""Where a mixture of experts' tokens go: routing recorded from real forwards.

`routed_forwards` decodes greedily and hands out each forward's routing (per layer: the expert ids,
their weights and the layer's FFN input); `trace_paths` keeps each token's activation path (the
experts it used at every layer), the raw material of EdgeMoE's path statistics (§3.3.2) and of the
replays that compare buffer policies. A prompt's own tokens are recorded too (a prefill routes them
as well).
"""

from __future__ import annotations

import torch

from models.transformer import Transformer


def routed_forwards(model: Transformer, prompt: list[int], n_new: int):
    """Greedy decoding of `n_new` tokens after `prompt`, one forward after another: yields that forward's
    [(expert ids [T, k], weights [T, k], FFN input h [T, dim]) per layer]."""
    if not model.args.moe:
        raise ValueError(f"{model.args.arch} is not a mixture of experts: it has no routing to trace")
    model.routes = []
    try:
        cache = model.new_cache(len(prompt) + n_new + 1)
        tokens = torch.tensor(prompt)
        for _ in range(n_new + 1):
            logits = model.forward(
                tokens, torch.arange(cache.end, cache.end + len(tokens)), cache, logits_rows=slice(-1, None)
            )
            cache.commit()
            yield list(model.routes)
            model.routes.clear()
            tokens = logits[-1:].argmax(-1)
    finally:
        model.routes = None


def trace_paths(model: Transformer, prompt: list[int], n_new: int) -> list[list[list[int]]]:
    """The path of every token forwarded: paths[token][layer] = the expert ids it routed to (best first)."""
    paths: list[list[list[int]]] = []
    for routes in routed_forwards(model, prompt, n_new):
        layers = [ids.tolist() for ids, _, _ in routes]  # [layer][row][k]
        paths += [[layer[r] for layer in layers] for r in range(len(layers[0]))]
    return paths
