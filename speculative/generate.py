"""Speculative generation in one process: draft a tree, verify it, keep the accepted path, repeat.

The actor runtime runs the same Drafter and Verifier in separate processes; this loop is the
reference for it and what the tests compare against target-only decoding.
"""
from __future__ import annotations

import time
from typing import Callable

from models.engine import Generation, LoadedModel, check_length
from models.sampling import SamplingConfig
from speculative.draft import Drafter, TreeConfig
from speculative.tree import best_branch
from speculative.verify import Verifier


def generate_speculative(target: LoadedModel, draft: LoadedModel, prompt_ids: list[int], max_new: int,
                         sampling: SamplingConfig, cfg: TreeConfig,
                         on_tokens: Callable[[list[int]], None] | None = None, stop_at_eos: bool = True) -> Generation:
    stop = target.tokenizer.stop_ids if stop_at_eos else set()
    cap = check_length(target.model, len(prompt_ids), max_new, slack=cfg.budget + 2)
    verifier, drafter = Verifier(target.model, sampling), Drafter(draft.model, sampling, cfg)
    t0 = time.perf_counter()
    first = verifier.start(prompt_ids, cap)
    drafter.start(prompt_ids, cap)
    t_prefill = time.perf_counter() - t0
    out = [first]
    drafter.pending.append(first)
    stats = {"verifications": 0, "accepted": 0, "drafted": 0, "draft_forwards": 0, "target_forwards": 1,
             "accepted_hist": {}}
    if on_tokens:
        on_tokens([first])
    while len(out) < max_new and out[-1] not in stop:
        remaining = max_new - len(out)
        d = drafter.build_tree(budget=min(cfg.budget, remaining - 1)) if remaining > 1 else None
        if d is None or len(d.tree) == 0:
            nxt = verifier.step(out[-1])
            new, path = [nxt], []
            drafter.advance(d, [], new)
        else:
            v = verifier.verify(d)
            path = v.path
            new = d.tree.tokens_of(path) + [v.next_token]
            drafter.advance(d, path, new)
            drafter.update_threshold(d, *best_branch(d.tree, path))
            stats["verifications"] += 1
            stats["accepted"] += len(path)
            stats["drafted"] += len(d.tree)
            stats["draft_forwards"] += d.forwards
            stats["accepted_hist"][len(path)] = stats["accepted_hist"].get(len(path), 0) + 1
        stats["target_forwards"] += 1
        for i, tok in enumerate(new):  # stop inside an accepted run
            if tok in stop or len(out) + i + 1 >= max_new:
                new = new[:i + 1]
                break
        out.extend(new)
        if on_tokens:
            on_tokens(new)
    stats["wasted"] = stats["drafted"] - stats["accepted"]
    stats["accepted_hist"] = {str(k): v for k, v in sorted(stats["accepted_hist"].items())}
    return Generation(prompt_ids, out[:max_new], time.perf_counter() - t0, t_prefill, stats)
