"""Generation in one process: the speculation cycle (speculative/loop.py) over the models themselves.

`generate_target` is the reference every speculative mode must equal under greedy decoding: the
target alone, one token per forward. The engine (engine/runner.py) runs the same loop over the
actors or, in one process, over the same sides as here.
"""

from __future__ import annotations

from common.settings import Generation, SamplingConfig, TreeConfig
from formats.loading import LoadedModel
from speculative.drafter import LocalDraft
from speculative.lookup import TrieDraft
from speculative.loop import Speculation
from speculative.verify import LocalTarget


def generate_target(
    lm: LoadedModel, prompt_ids: list[int], max_new: int, sampling: SamplingConfig, stop_at_eos: bool = True
) -> Generation:
    """Decode one token at a time with the target model: the output every other mode must equal."""
    loop = Speculation(
        LocalTarget(lm.model),
        None,
        "target",
        TreeConfig(adaptive=False),
        sampling,
        len(prompt_ids) + max_new,
        lm.args.context_length,
    )
    return loop.generate(prompt_ids, max_new, lm.tokenizer.stop_ids if stop_at_eos else set())


def generate_speculative(
    target: LoadedModel,
    draft: LoadedModel | None,
    prompt_ids: list[int],
    max_new: int,
    sampling: SamplingConfig,
    cfg: TreeConfig,
    stop_at_eos: bool = True,
) -> Generation:
    """Draft a tree, verify it, keep the accepted path, repeat; `draft` None: the n-gram trie alone."""
    side = (
        LocalDraft(draft.model)
        if draft is not None
        else TrieDraft(cfg.width, (str(target.store.dir), target.args.vocab_size))
    )
    loop = Speculation(
        LocalTarget(target.model), side, cfg.mode, cfg, sampling, len(prompt_ids) + max_new, target.args.context_length
    )
    return loop.generate(prompt_ids, max_new, target.tokenizer.stop_ids if stop_at_eos else set())
