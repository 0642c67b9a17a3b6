"""The speculation cycle, written once: draft, verify, keep the accepted path, repeat.

`Speculation` runs against two small interfaces, the draft side and the target side; what they
wrap decides where the work happens:

    in one process    speculative/local.py    LocalTarget, LocalDraft: the models themselves
    over the actors   scheduler/generation/target.py     ActorTarget: the verifier actor (streamed layers, the worker)
                      scheduler/generation/draft.py      ActorDraft: the draft actor
    either            speculative/lookup.py   TrieDraft: the n-gram trie alone (`--draft none`)

Target-only modes (target, std, stdpl) are the same loop with no draft. The governor, the
lookup arm, stop tokens, the KV capacity and the stats live here and nowhere else. Torch-free:
the scheduler process runs this loop.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol

from cadence.errors import CadenceError
from cadence.settings import LOOKUP, Generation, SamplingConfig, SpecStats, TreeConfig, budgets
from speculative.governor import Governor

MODES = ("target", "std", "stdpl", "chain", "tree")
TARGET_ONLY = ("target", "std", "stdpl")  # std, stdpl: the target alone, streamed (without / with prefetch)
AHEAD_WAIT = 0.2  # draft ahead while the verifier waits on I/O for more than this share of a verification


@dataclass
class Proposal:
    """Candidates for one verification: tree node i holds `tokens[i]` (a verdict's path indexes them)."""
    tokens: list[int]
    forwards: int = 0  # draft forwards that built it
    trie_nodes: int = 0  # of its nodes, those the trie proposed
    payload: object = None  # the tree in the draft side's form: a DraftTree in process, else its wire dict
    drafted: bool = True  # the draft model grew it (False: the trie's candidates alone, `advance` takes a plain verdict)
    tensors: dict = field(default_factory=dict)  # over the wire: the arena tensors that go with it (distributions)
    req: int | None = None  # over the wire: the draft's request that built it (the trace's arrow to its verification)


class TargetSide(Protocol):
    streamed: bool  # layers come from disk during a forward (the I/O-wait rule applies)
    io_wait: float | None  # measured share of a verification spent waiting for layers

    def start(self, prompt_ids: list[int], capacity: int, sampling: SamplingConfig) -> tuple[int, int]:
        """Prefill; (the first token, prompt tokens found in the cache from the last generation)."""

    def step(self, root: int) -> int:
        """A plain decode step on the root."""

    def verify(self, p: Proposal) -> tuple[list[int], int]:
        """One pass over the root and the tree: (accepted node path, the target's own next token)."""

    def take_stats(self) -> dict:
        """What the target side measured since the last call (I/O), for the JSON row."""


class DraftSide(Protocol):
    has_model: bool  # False: the trie alone (tree mode only; the governor plays the lookup arm)

    def start(self, prompt_ids: list[int], capacity: int, first: int, cfg: TreeConfig, sampling: SamplingConfig) -> None: ...

    def propose(self, budget: int, width: int) -> Proposal | None:
        """budget > 0: a draft tree of at most that many tokens; LOOKUP: the trie's candidates; None: none."""

    def ahead(self, p: Proposal, steps: int) -> None:
        """Draft on from the tree while the target verifies it, until the verdict (LLMCad 3.4)."""

    def advance(self, p: Proposal | None, path: list[int], new: list[int]) -> float | None:
        """The verdict (p None: a plain step, or candidates the draft did not run on); alpha after it."""

    def release(self, p: Proposal) -> None:
        """The proposal's resources (its distributions in the arena) may go."""

    def ahead_counts(self) -> tuple[int, int]:
        """(draft forwards run ahead, tree nodes that reused them) in this generation so far."""


def capacity(context_length: int, n_prompt: int, max_new: int, cfg: TreeConfig, draft: bool = False,
             at_least: int | None = None) -> int:
    """KV rows for a prompt and its continuation, a tree and its slack. The draft sees only the prompt's
    last `prompt_window` tokens; the target's cache holds `at_least` prompt tokens (a conversation's next
    prompt finds its prefix there). launch/runner.py plans memory with the same sum."""
    if n_prompt == 0:
        raise CadenceError("the prompt is empty after tokenization; give some text")
    if n_prompt + max_new > context_length:
        raise CadenceError(f"the prompt has {n_prompt} tokens and {max_new} new tokens were asked for, "
                           f"but the model's context holds {context_length}; shorten the prompt or lower --max-new-tokens")
    if draft and cfg.prompt_window:
        n_prompt = min(n_prompt, cfg.prompt_window)
    elif not draft and at_least:
        n_prompt = max(n_prompt, at_least)
    return min(context_length, n_prompt + max_new + max(cfg.budget, 64) + cfg.ahead + 2)


class Speculation:
    def __init__(self, target: TargetSide, draft: DraftSide | None, mode: str, cfg: TreeConfig, sampling: SamplingConfig,
                 context_length: int, kv_context: int | None = None, counter: Callable[[str, dict], None] | None = None):
        """The run's mode, tree settings and sampling (a generation may ask for others). `kv_context`: size the target's cache for prompts this long at least (None: per prompt).
        `counter(name, values)`: trace counters (tokens, accepted length, alpha)."""
        self.target, self.draft, self.mode, self.cfg, self.sampling = target, draft, mode, cfg, sampling
        self.context_length, self.kv_context = context_length, kv_context
        self.counter = counter or (lambda name, values: None)
        self.governors: dict[tuple, Governor] = {}  # per mode and budget set, kept across prompts

    def generate(self, prompt_ids: list[int], max_new: int, stop: set[int],
                 on_tokens: Callable[[list[int]], None] | None = None, on_cycle: Callable | None = None,
                 **kw) -> Generation:
        """`stream` to its end: `on_tokens(new_ids)` as tokens are committed; `on_cycle(n_new, accepted,
        alpha)` after each cycle (accepted and alpha are None for a plain target step): the monitor's feed."""
        steps = self.stream(prompt_ids, max_new, stop, **kw)
        while True:
            try:
                new, accepted, alpha = next(steps)
            except StopIteration as done:
                return done.value
            if on_tokens:
                on_tokens(new)
            if on_cycle:
                on_cycle(len(new), accepted, alpha)

    def stream(self, prompt_ids: list[int], max_new: int, stop: set[int], mode: str | None = None,
               cfg: TreeConfig | None = None, sampling: SamplingConfig | None = None) -> Iterator:
        """Generate with this run's mode, or another one (`target` always; `chain`/`tree` need a draft).
        A generator: after the prefill and after each cycle it yields (the tokens committed, accepted draft
        tokens, alpha) (None, None for a plain step) and it returns the Generation. Each yield is a cycle
        boundary, where both models' caches agree with the text: a consumer may stop there (a client that
        went away), and the next generation starts afresh."""
        mode, cfg, draft = mode or self.mode, cfg or self.cfg, self.draft
        speculative = mode not in TARGET_ONLY
        if speculative and draft is None:
            raise ValueError(f"mode {mode} needs a draft, which this run did not start")
        if mode == "chain" and not draft.has_model:
            raise ValueError("mode chain needs a draft model; --draft none speculates in tree mode only")
        sampling = sampling or self.sampling
        cap = capacity(self.context_length, len(prompt_ids), max_new, cfg, at_least=self.kv_context)
        t0 = time.perf_counter()
        first, reused = self.target.start(prompt_ids, cap, sampling)
        if speculative:
            draft.start(prompt_ids, capacity(self.context_length, len(prompt_ids), max_new, cfg, draft=True),
                        first, cfg, sampling)
        t_prefill = time.perf_counter() - t0
        governor = None
        if speculative and (cfg.adaptive or not draft.has_model):  # what speculation earned on earlier prompts carries over
            arms = budgets(cfg) if draft.has_model else (LOOKUP, 0)  # no draft model: the trie or a plain step
            governor = self.governors.setdefault((mode, arms), Governor(arms, cfg.budget if draft.has_model else LOOKUP))
            governor.new_text()
        stats = SpecStats()
        out = [first]
        yield [first], None, None
        while len(out) < max_new and out[-1] not in stop:
            budget = 0 if not speculative else min(governor.choose() if governor else cfg.budget, max_new - len(out) - 1)
            stats.budget_hist[budget] = stats.budget_hist.get(budget, 0) + 1
            t_cycle = time.perf_counter()
            new, accepted, alpha = self._cycle(budget, out[-1], stats, cfg, sampling, draft if speculative else None)
            now = time.perf_counter()
            if governor:
                governor.record(budget, len(new), now - t_cycle)
            for i, tok in enumerate(new):  # stop inside an accepted run
                if tok in stop or len(out) + i + 1 >= max_new:
                    new = new[:i + 1]
                    break
            out.extend(new)
            self.counter("tokens", {"total": len(out)})
            yield new, accepted, alpha
        st = stats.as_dict() if speculative else {"target_forwards": stats.target_forwards}
        if speculative:
            st["ahead_steps"], st["ahead_reused"] = draft.ahead_counts()
        st["reused_prompt_tokens"] = reused  # found in the KV cache from the last generation
        st.update(self.target.take_stats())
        return Generation(prompt_ids, out[:max_new], time.perf_counter() - t0, t_prefill, st)

    def ahead_steps(self, cfg: TreeConfig) -> int:
        """Draft forwards the draft may run during this verification (LLMCad's speculative drafting).
        Two cores cannot draft and verify at once for free: with `ahead_auto` the draft drafts ahead
        only while the verifier spends more than AHEAD_WAIT of its verifications waiting for layers
        (measured, a moving average), when a core would idle otherwise."""
        if not cfg.ahead_auto:
            return cfg.ahead
        if not self.target.streamed:
            return 0
        w = self.target.io_wait
        return cfg.ahead if w is None or w > AHEAD_WAIT else 0

    def _cycle(self, budget: int, root: int, stats: SpecStats, cfg: TreeConfig, sampling: SamplingConfig,
               draft: DraftSide | None) -> tuple[list[int], int | None, float | None]:
        """One draft-verify cycle (budget 0: a plain target step; LOOKUP: the trie's candidates verified,
        no draft forward): (the committed tokens, accepted draft tokens, alpha)."""
        stats.target_forwards += 1
        p = None
        if draft is not None and budget != 0:
            t = time.perf_counter()
            p = draft.propose(budget, cfg.width)
            if budget > 0:
                stats.draft_s += time.perf_counter() - t
        t = time.perf_counter()
        try:
            if p is None or not p.tokens:
                nxt = self.target.step(root)
                stats.plain_steps += 1
                if draft is not None:
                    draft.advance(p if budget > 0 else None, [], [nxt])
                stats.verify_s += time.perf_counter() - t
                return [nxt], None, None
            if budget > 0 and sampling.greedy and (n := self.ahead_steps(cfg)):
                draft.ahead(p, n)  # the draft drafts on while the target verifies; the verdict interrupts it
            path, nxt = self.target.verify(p)
            new = [p.tokens[i] for i in path] + [nxt]
            alpha = draft.advance(p if p.drafted else None, path, new)
        finally:
            if p is not None:
                draft.release(p)
        stats.verify_s += time.perf_counter() - t
        stats.record_verification(p, path)
        self.counter("accepted", {"length": len(path), "tree": len(p.tokens)})
        if alpha is not None:
            stats.alpha.append(alpha)
            self.counter("alpha", {"alpha": alpha})
        return new, len(path), alpha
