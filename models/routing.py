"""Where a mixture of experts' tokens go: routing traces recorded from real forwards.

`trace_paths` decodes greedily and records each token's activation path (the experts it used at
every layer), the raw material of EdgeMoE's path statistics (§3.3.2) and of the replays that
compare buffer policies. A prompt's own tokens are recorded too (a prefill routes them as well).
"""
from __future__ import annotations

import torch

from models.transformer import Transformer


def trace_paths(model: Transformer, prompt: list[int], n_new: int) -> list[list[list[int]]]:
    """Greedy decoding of `n_new` tokens after `prompt`; the path of every token forwarded:
    paths[token][layer] = the expert ids it routed to (in the router's order, best first)."""
    if not model.args.moe:
        raise ValueError(f"{model.args.arch} is not a mixture of experts: it has no routing to trace")
    model.routes = []
    try:
        cache = model.new_cache(len(prompt) + n_new + 1)
        tokens = torch.tensor(prompt)
        paths: list[list[list[int]]] = []
        for _ in range(n_new + 1):
            logits = model.forward(tokens, torch.arange(cache.end, cache.end + len(tokens)), cache, logits_rows=slice(-1, None))
            cache.commit()
            layers = [ids.tolist() for ids, _, _ in model.routes]  # [layer][row][k]
            paths += [[layers[i][r] for i in range(len(layers))] for r in range(len(tokens))]
            model.routes.clear()
            tokens = logits[-1:].argmax(-1)
        return paths
    finally:
        model.routes = None
