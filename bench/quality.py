"""Measurements behind `launch bench --suite formats`: the verifier's cost curve and quality."""

from __future__ import annotations

import statistics
import time

import torch

from models.attention import Visibility
from formats.loading import LoadedModel
from models.transformer import Transformer

# A short text besides the prompts, for the mean log-likelihood: code and prose.
SHORT_TEXT = '''def merge_sorted(a, b):
    """Merge two sorted lists into one sorted list."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i])
            i += 1
        else:
            out.append(b[j])
            j += 1
    return out + a[i:] + b[j:]

A hash table stores values under keys. It computes an index from each key with a hash function and
keeps the entry in the bucket at that index, so that looking a key up takes about the same time no
matter how many entries the table holds.
'''


def cost_curve(model: Transformer, widths=(1, 4, 16, 64), context: int = 256, reps: int = 3) -> list[float]:
    """Seconds of one verification pass of `width` tree tokens (a chain) after `context` tokens."""
    cache = model.new_cache(context + max(widths) + 1)
    ids = torch.arange(context) % 1000 + 100
    model.forward(ids, torch.arange(context), cache)
    cache.commit()
    out = []
    for w in widths:
        toks = torch.arange(w) % 1000 + 200
        pos = torch.arange(context, context + w)
        vis = Visibility.tree(context, [i - 1 for i in range(w)])
        times = []
        for _ in range(reps + 1):
            t = time.perf_counter()
            model.forward(toks, pos, cache, vis)
            times.append(time.perf_counter() - t)
            cache.rewind(context)
        out.append(statistics.median(times[1:]))
    return out


def mean_loglik(lm: LoadedModel, prompts, extra: str = SHORT_TEXT) -> float:
    """Mean log-probability per token of the prompt texts and a short text (teacher forcing)."""
    total, n = 0.0, 0
    for text in [p.text for p in prompts] + [extra]:
        ids = lm.tokenizer.encode(text)
        if len(ids) < 2:
            continue
        cache = lm.model.new_cache(len(ids))
        logits = lm.model.forward(torch.tensor(ids), torch.arange(len(ids)), cache)
        lp = torch.log_softmax(logits[:-1].float(), -1).gather(1, torch.tensor(ids[1:])[:, None])
        total += float(lp.sum())
        n += len(ids) - 1
    return total / max(n, 1)
