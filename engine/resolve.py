"""A run's configuration resolved once, before anything loads: the weight stores (converted on first
use), the draft `auto` picks, the ARCA profile's tree and partition, the prompts as token ids, the
context, a mixture of experts' path profile. `Runner`, `launch plan` and `launch bench --cgroup` all
start here, so they run what one another plan.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from common.errors import CadenceError, PromptError
from common.settings import WorkerSplit
from engine import drafts
from engine.config import RunConfig
from engine.profiles import load_profile, parse_partition
from engine.prompts import Prompt, encode_prompt
from models import registry
from models.convert import ensure_store
from models.store import WeightStore
from models.tokenizer import TextTokenizer

DEFAULT_CONTEXT = 4096  # tokens a generation holds when nothing says how many (ollama and llama-cli take as many)
BUDGET_CONTEXT = 2048  # ... under a memory budget, where every token's KV rows are memory the target could use


@dataclass
class Resolved:
    cfg: RunConfig  # draft, context and profile resolved
    target: WeightStore
    draft: WeightStore | None  # None: no draft model
    tokenizer: TextTokenizer
    encoded: dict = field(default_factory=dict)  # prompt key -> (token ids, chat applied), or why it cannot run
    paths: object = None  # a mixture of experts' path profile (scheduler/generation/expert_policy.py), or None
    draft_picked: bool = False  # `--draft auto` chose the draft: under a budget, `settle_draft` may drop it

    def prompt_ids(self, prompt: Prompt) -> tuple[list[int], bool]:
        """The prompt's token ids (after the chat template, if it gets one) and whether it got one."""
        if prompt.ids is not None:
            return list(prompt.ids), bool(prompt.chat)
        got = self.encoded.get(prompt.key(self.cfg.chat))
        if isinstance(got, PromptError):
            raise got
        return got or encode_prompt(self.tokenizer, prompt, self.cfg.chat, self.cfg.context)


def resolve(cfg: RunConfig, prompts: list[Prompt] | None = None, say: Callable[[str], None] | None = None) -> Resolved:
    """`cfg` with its stores, draft, profile and context resolved; `prompts` (if known) encoded, the
    context sized to the longest. `say`: where a line about a choice made goes (stderr)."""
    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    profile = load_profile(cfg.profile) if cfg.profile else None  # a bad file is refused before any conversion
    if cfg.draft_model:  # from the models' vocabularies: a draft that cannot serve is refused before any conversion
        drafts.check_draft(cfg.target, cfg.draft)
    target = ensure_store(cfg.target, cfg.dtype)
    picked = cfg.draft == "auto" and cfg.mode == "tree"
    if cfg.draft == "auto":
        cfg = cfg.replace(draft=pick_draft(cfg, say) if cfg.speculative else "none")
    draft = ensure_store(cfg.draft, cfg.draft_format) if cfg.draft_model else None
    if profile is not None:
        cfg = apply_profile(cfg, profile)
    tokenizer = TextTokenizer(target.tokenizer_info)
    encoded = {}
    for p in prompts or ():
        try:
            encoded[p.key(cfg.chat)] = encode_prompt(tokenizer, p, cfg.chat, cfg.context or target.args.context_length)
        except PromptError as e:  # this prompt cannot run: the run says so when it comes to it, the others run
            encoded[p.key(cfg.chat)] = e
    lengths = [len(got[0]) for got in encoded.values() if not isinstance(got, PromptError)]
    cfg = cfg.replace(context=context(cfg, target, lengths))
    return Resolved(cfg, target, draft, tokenizer, encoded, expert_paths(cfg, target), picked and draft is not None)


def context(cfg: RunConfig, target: WeightStore, prompt_lengths: list[int]) -> int:
    """Tokens a generation holds: --context; else the longest prompt plus --max-new-tokens where both are
    known; else DEFAULT_CONTEXT (BUDGET_CONTEXT under a memory budget; more if the longest prompt needs it);
    at most the model's context."""
    most = target.args.context_length
    if cfg.context is not None:
        if cfg.context > most:
            raise CadenceError(
                f"--context {cfg.context} is more than {cfg.target} holds ({most} tokens); give at most {most}"
            )
        return cfg.context
    longest = max(prompt_lengths, default=0)
    if longest and cfg.max_new_tokens:
        return min(most, longest + cfg.max_new_tokens)
    return min(most, max(BUDGET_CONTEXT if cfg.memory_budget else DEFAULT_CONTEXT, longest + 512))


def apply_profile(cfg: RunConfig, prof: dict) -> RunConfig:
    """An ARCA profile's choices (launch profile): its width and static tree (tree mode), its partition."""
    tree, worker = cfg.tree, cfg.worker
    if prof["width"] > 0 and cfg.mode == "tree":
        tree = dataclasses.replace(
            tree,
            width=prof["width"],
            width_auto=False,
            trie=False,
            adaptive=False,
            shape_parents=tuple(prof["tree"]["parents"]),
            shape_ranks=tuple(prof["tree"]["ranks"]),
        )
    if prof["partition"] != "none":
        worker = WorkerSplit(*parse_partition(prof["partition"]))
    return cfg.replace(tree=tree, worker=worker)


def pick_draft(cfg: RunConfig, say: Callable[[str], None]) -> str:
    """The draft for `--draft auto` (engine/drafts.py: the default draft if it shares the target's vocabulary
    and is the smaller model, else the smallest model on this machine that does), else "none" (the n-gram trie
    alone). Says which in one line when it is not the default."""
    name = drafts.pick(cfg.target)
    if name is not None:
        if name != registry.DEFAULT_DRAFT:
            why = "is not smaller than {}" if drafts.default_shares(cfg.target) else "does not share {}'s tokenizer"
            say(f"draft: {name} (the default draft {registry.DEFAULT_DRAFT} {why.format(cfg.target)})")
        return name
    if cfg.mode == "chain":
        raise CadenceError(
            f"no model on this machine shares {cfg.target}'s tokenizer and is smaller; give --draft, or use --mode "
            "tree (with no draft model the n-gram trie proposes)"
        )
    say(
        f"draft: none ({cfg.target} shares its tokenizer with no smaller model on this machine): the n-gram trie of "
        "the prompt and the output proposes"
    )
    return "none"


def expert_paths(cfg: RunConfig, target: WeightStore):
    """A mixture of experts' path profile, read from beside its store where the buffer's policies use it."""
    e = cfg.experts
    if not target.args.moe or not (e.preload == "paths" or e.eviction == "edgemoe"):
        return None
    from scheduler.generation.expert_policy import PATHS_FILE, PathStats

    path = Path(target.dir) / PATHS_FILE
    if path.exists():
        return PathStats.load(path)
    if e.preload == "paths":
        raise CadenceError(
            f"--expert-preload paths needs the expert path profile of {target.dir.name}; write it "
            f"with `launch models profile-experts {cfg.target}`"
        )
    return None
