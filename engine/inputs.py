"""What a run reads before it decides anything (engine/decide.py): the target's weight store (converted on first
use) and tokenizer, and the prompts it will run as token ids, whose lengths size the context.

    machine = ThisMachine()
    inputs = read_inputs(cfg, machine, prompts)
    plan = decide(cfg, machine, inputs.lengths())
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.errors import PromptError
from common.modes import Mode
from engine.config import RunConfig
from engine.prompts import Prompt, encode_prompt
from formats.store import WeightStore
from text.tokenizer import TextTokenizer


@dataclass
class Inputs:
    target: WeightStore
    tokenizer: TextTokenizer
    chat: str  # auto, on, off: whether a prompt gets the chat template
    context: int  # the most tokens a prompt may take (the model's, until the plan's context is known)
    encoded: dict = field(default_factory=dict)  # prompt key -> (token ids, chat applied), or why it cannot run

    def lengths(self) -> tuple[int, ...]:
        """The token counts of the prompts that can run."""
        return tuple(len(got[0]) for got in self.encoded.values() if not isinstance(got, PromptError))

    def prompt_ids(self, prompt: Prompt) -> tuple[list[int], bool]:
        """The prompt's token ids (after the chat template, if it gets one) and whether it got one."""
        if prompt.ids is not None:
            n = self.target.args.vocab_size
            if any(not 0 <= t < n for t in prompt.ids):
                bad = next(t for t in prompt.ids if not 0 <= t < n)
                raise PromptError(f"the prompt's token id {bad} is outside the model's vocabulary of {n} tokens")
            return list(prompt.ids), bool(prompt.chat)
        got = self.encoded.get(prompt.key(self.chat))
        if isinstance(got, PromptError):
            raise got
        return got or encode_prompt(self.tokenizer, prompt, self.chat, self.context)

    def hold_tokenizer(self, encodes_more: bool) -> None:
        """The tokenizer as the run's process holds it from now on, before its plan measures that process: a run
        whose prompts are all encoded decodes from a table of the tokens' bytes and gives its encoder's pages to the
        target; a door that keeps encoding (serve, chat, cadence.LLM) keeps an encoder a fifth the size of
        `tokenizers`' (text/bytebpe.py) where the vocabulary is one it reads."""
        if encodes_more:
            self.tokenizer.compact_encoder()
        else:
            self.tokenizer.release_encoder()


def read_inputs(cfg: RunConfig, machine, prompts: list[Prompt] | None = None) -> Inputs:
    """The target's store and tokenizer, and `prompts` (if known) encoded; a bad profile or a draft that cannot
    serve the target is refused first, before any conversion."""
    if cfg.profile:
        machine.profile(cfg.profile)
    if cfg.draft_model:
        machine.check_draft(cfg.target, cfg.draft)
    target = machine.store(cfg.target, cfg.dtype)
    inputs = Inputs(target, TextTokenizer(target.tokenizer_info), cfg.chat, cfg.context or target.args.context_length)
    for p in prompts or ():
        try:
            inputs.encoded[p.key(cfg.chat)] = encode_prompt(inputs.tokenizer, p, cfg.chat, inputs.context)
        except PromptError as e:  # this prompt cannot run: the run says so when it comes to it, the others run
            inputs.encoded[p.key(cfg.chat)] = e
    return inputs


@dataclass(frozen=True)
class Pair:
    cfg: RunConfig  # tree mode, the draft `auto` picks in place of auto, the context sized
    target: WeightStore
    draft: WeightStore | None


def tree_pair(cfg: RunConfig, machine, prompts: list[Prompt]) -> Pair:
    """The tree run each mode of a benchmark is made from, as a run would read it: the draft `auto` picks (a model
    even where a budget would settle on none: chain needs one), the context sized to the prompts."""
    from engine.decide import context

    tree = cfg.with_mode(Mode.TREE)
    inputs = read_inputs(tree, machine, prompts)
    inputs.tokenizer.release_encoder()  # as each run's scheduler does before its plan measures it
    picked = (machine.pick_draft(cfg.target)[0] or "none") if tree.draft == "auto" else tree.draft
    tree = tree.replace(draft=picked, context=context(tree, inputs.target, inputs.lengths()))
    return Pair(tree, inputs.target, machine.store(picked, tree.draft_format) if tree.draft_model else None)
