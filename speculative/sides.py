"""The two sides of a speculation cycle and what passes between them (speculative/loop.py runs the cycle,
speculative/batch.py answers every generation's calls of a cycle together).

What the sides wrap decides where the work happens:

    in one process    speculative/drafter.py, verify.py    LocalDraft, LocalTarget: the models themselves
    over the actors   scheduler/generation/draft_side.py     ActorDraft: the draft actor
                      scheduler/generation/target_side.py    ActorTarget: the verifier actor (streamed layers)
    either            speculative/lookup.py                  TrieDraft: the n-gram trie alone (`--draft none`)

A generation asks each side for its work as a `Call`; a draft side answers with a `Proposal` the target side
verifies; each cycle ends in a `CycleOutcome`. `slack` and `limits` size a generation's caches and its answer.
Torch-free: the scheduler process runs the cycle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

from common.errors import PromptError
from common.settings import DRAFT_ROWS, Generation, SamplingConfig, TreeConfig
from speculative.kvpool import Placed
from speculative.tree import Tree


@dataclass
class Proposal:
    """Candidates for one verification: what the target side verifies (`tree`), and what the draft side
    keeps of it until the verdict (`draft`: a DraftTree in process, nothing over the wire: the actor has it)."""

    tree: Tree
    drafted: bool = True  # the draft model ran on it (False: the trie's candidates alone, the draft takes its verdict as a plain step's)
    draft: object = None
    req: int | None = None  # over the wire: the draft's request that built it (the trace's arrow to its verification)

    @property
    def tokens(self) -> list[int]:
        return self.tree.tokens


@dataclass(frozen=True)
class CycleOutcome:
    """One cycle: the tokens it committed (a stop token, if reached, is the last), the draft tokens the
    target accepted and alpha after it (None for the prefill and a plain step). The last outcome of a
    generation also says why it ended ("stop": a stop token; "length": the token limit or the context)
    and carries the `Generation`."""

    tokens: list[int]
    accepted: int | None = None
    alpha: float | None = None
    finish_reason: str | None = None
    result: Generation | None = None


# What a generation asks of a side (`Speculation.steps` yields it): of the target side a prefill (`Start`), a plain
# step (`Step`) or a verification (`Verify`), of the draft side a tree (`Propose`), of either its figures
# (`TakeStats`). A batch (speculative/batch.py) answers every generation's calls of a cycle in shared forwards; one
# generation's own side, `Alone`, each as it comes. `op`: the verifier's name for it over the wire.


@dataclass(frozen=True)
class Start:
    """Prefill `prompt_ids` into a cache of `capacity` rows: (the first token, tokens of the prompt found cached).
    `placed`: its range of a batch's KV pool (speculative/kvpool.py), None where the side keeps a cache of its own."""

    prompt_ids: list[int]
    capacity: int
    sampling: SamplingConfig
    reuse: bool = True
    placed: Placed | None = None
    op: ClassVar[str] = "start"


@dataclass(frozen=True)
class Step:
    """A plain decode step on `root`: the next token."""

    root: int
    op: ClassVar[str] = "step"


@dataclass(frozen=True)
class Verify:
    """One pass over the root and `proposal`'s tree: (the accepted node path, the target's own next token)."""

    proposal: Proposal
    op: ClassVar[str] = "verify"


@dataclass(frozen=True)
class Propose:
    """The draft side's tree of at most `budget` tokens, or None; then at most `ahead` draft forwards on from it
    while the target verifies it (LLMCad 3.4), where the tree has tokens."""

    budget: int
    ahead: int = 0


@dataclass(frozen=True)
class TakeStats:
    """What the target side measured for this generation (answered without a forward)."""


TargetCall = Start | Step | Verify
Call = Start | Step | Verify | Propose | TakeStats


class TargetSide(Protocol):
    streamed: bool  # layers come from disk during a forward (the I/O-wait rule applies)
    io_wait: float | None  # measured share of a verification spent waiting for layers

    def start(
        self, prompt_ids: list[int], capacity: int, sampling: SamplingConfig, reuse: bool = True
    ) -> tuple[int, int]:
        """Prefill; (the first token, prompt tokens found in the cache from the last generation, which
        `reuse` False forgets: the whole prompt prefilled)."""

    def step(self, root: int) -> int:
        """A plain decode step on the root."""

    def verify(self, p: Proposal) -> tuple[list[int], int]:
        """One pass over the root and the tree: (accepted node path, the target's own next token)."""

    def take_stats(self) -> dict:
        """What the target side measured since the last call (I/O), for the JSON row."""


class DraftSide(Protocol):
    has_model: bool  # False: the trie alone (tree mode only; the governor plays the lookup arm)

    def start(
        self, prompt_ids: list[int], capacity: int, first: int, cfg: TreeConfig, sampling: SamplingConfig
    ) -> None: ...

    def propose(self, budget: int, ahead: int = 0) -> Proposal | None:
        """A draft tree of at most `budget` tokens, or None; then up to `ahead` draft forwards on from it while the
        target verifies it, until the verdict (LLMCad 3.4)."""

    def lookup(self, max_nodes: int) -> Proposal | None:
        """The trie's candidates alone (prompt lookup, no draft forward), or None."""

    def advance(self, p: Proposal | None, path: list[int], new: list[int]) -> float | None:
        """The verdict (p None: a plain step, or candidates the draft did not run on); alpha after it."""

    def ahead_counts(self) -> tuple[int, int]:
        """(draft forwards run ahead, tree nodes that reused them) in this generation so far."""

    def take_stats(self) -> dict:
        """What the draft side measured since the last call (a flash draft's reads), for the JSON row."""


class BatchTarget(Protocol):
    streamed: bool  # layers come from disk during a forward: a forward costs one read whatever its rows

    def answer(self, calls: list[tuple[int, TargetCall]]) -> list:
        """Each (slot, call) answered as a target side of that slot's generation alone would answer it."""

    def release(self, slot: int) -> None:
        """The slot's generation was cancelled: its cache goes."""

    def take_stats(self, slot: int) -> dict: ...


class Alone:
    """The batch target of one generation: the run's own target side, each call answered as it comes. Where it
    streams, the draft drafts on while it verifies (`Speculation.ahead_steps` reads `streamed` and `io_wait`)."""

    def __init__(self, side: TargetSide):
        self.side = side

    @property
    def streamed(self) -> bool:
        return self.side.streamed

    @property
    def io_wait(self) -> float | None:
        return self.side.io_wait

    def answer(self, calls: list[tuple[int, TargetCall]]) -> list:
        """Each call answered by the side, in turn."""
        return [self._one(c) for _, c in calls]

    def _one(self, c: TargetCall):
        if isinstance(c, Verify):
            return self.side.verify(c.proposal)
        if isinstance(c, Step):
            return self.side.step(c.root)
        if isinstance(c, Start):
            return self.side.start(c.prompt_ids, c.capacity, c.sampling, c.reuse)
        raise TypeError(f"a target side answers a Start, Step or Verify, not {c!r}")

    def release(self, slot: int) -> None:
        """Nothing to drop: the side's next generation starts afresh where this one stopped."""

    def take_stats(self, slot: int) -> dict:
        return self.side.take_stats()


class NoAhead:
    """What a batched generation's I/O-wait rule reads: nobody drafts ahead of a batch's verification (the draft
    side grows the next generation's tree meanwhile)."""

    streamed = False
    io_wait = None


def slack(cfg: TreeConfig, draft: bool = False) -> int:
    """KV rows past the text: a tree in verification (the draft's: every node it ran on, at most DRAFT_ROWS times
    the budget; the target's, the default: the budget's nodes), the chain drafted ahead, root and bonus token."""
    return (DRAFT_ROWS if draft else 1) * cfg.budget + cfg.ahead + 2


def limits(context: int, n_prompt: int, max_new: int | None, bound: int | None = None) -> int:
    """The most new tokens for a prompt of `n_prompt` tokens in a context of `context`: `max_new`, or
    (None) up to the context's end or `bound`, whichever comes first. One sentence when the prompt leaves no
    room."""
    if n_prompt == 0:
        raise PromptError("the prompt is empty after tokenization; give some text")
    room = context - n_prompt
    if room < 1 or (max_new is not None and max_new > room):
        asked = f" and {max_new} new tokens were asked for" if max_new is not None else ""
        raise PromptError(
            f"the prompt has {n_prompt} tokens{asked}, but the context holds {context}; shorten the "
            "prompt, lower --max-new-tokens or give a larger --context",
            "max_tokens" if room >= 1 else "prompt",
        )
    return max_new if max_new is not None else min(room, bound or room)
