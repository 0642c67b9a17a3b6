"""Speculative generation in one process: draft a tree, verify it, keep the accepted path, repeat.

The actor runtime runs the same Drafter and Verifier in separate processes; this loop is the
reference for it and what the tests compare against target-only decoding.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from cadence.settings import LOOKUP, Generation, SpecStats, budgets  # noqa: F401  (torch-free, re-exported)
from models.engine import LoadedModel, check_length
from models.sampling import SamplingConfig
from speculative.draft import Drafter, DraftTree, TreeConfig
from speculative.governor import Governor
from speculative.tree import best_branch
from speculative.verify import Verifier


def generate_speculative(target: LoadedModel, draft: LoadedModel, prompt_ids: list[int], max_new: int,
                         sampling: SamplingConfig, cfg: TreeConfig,
                         on_tokens: Callable[[list[int]], None] | None = None, stop_at_eos: bool = True) -> Generation:
    stop = target.tokenizer.stop_ids if stop_at_eos else set()
    cap = check_length(target.model, len(prompt_ids), max_new, slack=cfg.budget + cfg.ahead + 2)
    verifier, drafter = Verifier(target.model, sampling), Drafter(draft.model, sampling, cfg)
    governor = Governor(budgets(cfg), cfg.budget) if cfg.adaptive else None
    stats = SpecStats()
    t0 = time.perf_counter()
    first = verifier.start(prompt_ids, cap)
    drafter.start(prompt_ids, cap)
    t_prefill = time.perf_counter() - t0
    out = [first]
    drafter.push([first])
    if on_tokens:
        on_tokens([first])
    while len(out) < max_new and out[-1] not in stop:
        remaining = max_new - len(out)
        budget = governor.choose() if governor else cfg.budget
        budget = min(budget, remaining - 1)
        stats.budget_hist[budget] = stats.budget_hist.get(budget, 0) + 1
        t_cycle = time.perf_counter()
        d = None
        if budget > 0:
            d = drafter.build_tree(budget)
            stats.draft_s += time.perf_counter() - t_cycle
        elif budget == LOOKUP:
            d = drafter.lookup(cfg.width)
        t_verify = time.perf_counter()
        if d is None or len(d.tree) == 0:
            new, path = [verifier.step(out[-1])], []
            drafter.advance(d if budget > 0 else None, [], new)
            stats.plain_steps += 1
        else:
            if budget > 0:
                drafter.look_ahead(d, cfg.ahead)  # in one process: the draft's lookahead runs before the verdict
            v = verifier.verify(d)
            path = v.path
            new = d.tree.tokens_of(path) + [v.next_token]
            if budget > 0:
                drafter.advance(d, path, new)
                drafter.update_threshold(d, *best_branch(d.tree, path))
            else:  # prompt lookup: the draft ran on none of it
                drafter.advance(None, path, new)
            stats.record_verification(d, path)
            stats.alpha.append(drafter.threshold.alpha)
        now = time.perf_counter()
        stats.verify_s += now - t_verify
        stats.target_forwards += 1
        if governor:
            governor.record(budget, len(new), now - t_cycle)
        for i, tok in enumerate(new):  # stop inside an accepted run
            if tok in stop or len(out) + i + 1 >= max_new:
                new = new[:i + 1]
                break
        out.extend(new)
        if on_tokens:
            on_tokens(new)
    stats.ahead_steps, stats.ahead_reused = drafter.ahead_steps, drafter.ahead_reused
    return Generation(prompt_ids, out[:max_new], time.perf_counter() - t0, t_prefill, stats.as_dict())
