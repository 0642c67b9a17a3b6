"""Generation in one process: the speculation cycle (speculative/loop.py) over the models themselves.

`generate_target` is the reference every speculative mode must equal under greedy decoding: the
target alone, one token per forward. The actor runtime (scheduler/generation/speculation.py) runs the same
loop with proxies over the wire.
"""
from __future__ import annotations

from typing import Callable

from cadence.settings import LOOKUP, Generation, SpecStats, budgets  # noqa: F401  (torch-free, re-exported)
from models.engine import LoadedModel
from models.sampling import SamplingConfig
from speculative.draft import TreeConfig
from speculative.local import LocalDraft, LocalTarget
from speculative.lookup import TrieDraft
from speculative.loop import Speculation


def generate_target(lm: LoadedModel, prompt_ids: list[int], max_new: int, sampling: SamplingConfig,
                    on_tokens: Callable[[list[int]], None] | None = None, stop_at_eos: bool = True) -> Generation:
    """Decode one token at a time with the target model: the output every other mode must equal."""
    loop = Speculation(LocalTarget(lm.model), None, "target", TreeConfig(adaptive=False), sampling, lm.args.context_length)
    return loop.generate(prompt_ids, max_new, lm.tokenizer.stop_ids if stop_at_eos else set(), on_tokens)


def generate_speculative(target: LoadedModel, draft: LoadedModel | None, prompt_ids: list[int], max_new: int,
                         sampling: SamplingConfig, cfg: TreeConfig,
                         on_tokens: Callable[[list[int]], None] | None = None, stop_at_eos: bool = True) -> Generation:
    """Draft a tree, verify it, keep the accepted path, repeat; `draft` None: the n-gram trie alone."""
    side = LocalDraft(draft.model) if draft is not None else TrieDraft(cfg.width)
    loop = Speculation(LocalTarget(target.model), side, cfg.mode, cfg, sampling, target.args.context_length)
    return loop.generate(prompt_ids, max_new, target.tokenizer.stop_ids if stop_at_eos else set(), on_tokens)
