"""The target side: one forward over the whole tree, then acceptance and the cache kept to it.

Every job (prefill, plain step, tree verification) is written as a generator over the model's
`forward_steps`: it yields the model's requests (models/requests.py: each layer it needs, the parts it
splits) and takes the answers back. With all weights resident, `drive` feeds it at once; a
streaming verifier feeds it layer by layer as the loader brings them in, and a `planner` (the
split executor, actors/executor.py) gives each forward its split (actors/verifier.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from common.errors import CadenceError
from models.attention import Visibility
from models.batch import Rows, forward_many_steps
from common.settings import PREFILL_CHUNK, PROMPT_LOGPROBS_CHUNK
from speculative.grammar import Constraint, source_of
from models.sampling import choose, token_logprobs
from common.settings import SamplingConfig
from models.transformer import Transformer
from models.requests import drive
from speculative.sides import Proposal
from speculative.prefixes import MIN_TOKENS, PrefixCache
from speculative.tree import TokenTree, Verdict, longest_accepted_path


class Verifier:
    def __init__(
        self,
        model: Transformer,
        sampling: SamplingConfig,
        previous: "Verifier | None" = None,
        prefixes: PrefixCache | None = None,
    ):
        """`previous`: the last generation's verifier, whose KV cache a prompt that continues its text
        (a conversation's next turn, a shared system prompt) picks up instead of prefilling again; `prefixes`: the
        prompt cache (speculative/prefixes.py) that keeps what the cache loses and offers longer prefixes."""
        self.model, self.sampling, self.prefixes = model, sampling, prefixes
        self.cache = previous.cache if previous is not None else None
        if previous is not None:  # the cache moves here: a new prompt's cache is made once nothing holds the old
            previous.cache = None
        self.tokens: list[int] = (
            list(previous.tokens) if previous is not None else []
        )  # what the cache holds, committed
        self.reused = 0  # prompt tokens the last start found in the cache
        self.chunks: list[list[int]] = []  # the prompt's chunks still to prefill
        self.constraint: Constraint | None = None  # the sampling's grammar, over what follows the prompt
        self.logprobs: list = []  # where asked for: each token chosen since the last take, with its log-probabilities
        self.prompt_logprobs: list | None = None  # where asked for: each prompt token's (the first's None)

    # -- jobs as generators ------------------------------------------------------------------

    def start_steps(self, prompt_ids: list[int], capacity: int, storage: torch.Tensor | None = None, planner=None):
        """Prefill the prompt (in chunks); returns the first generated token. `storage`: where the KV cache
        lives. The longest prefix the cache holds already (from the last generation) is kept, not prefilled
        again: a row's keys and values do not depend on the rows computed with it, so this is exact.
        `planner(vis)`: each forward's `ForwardPlan` (or None)."""
        self.begin_prompt(prompt_ids, capacity, storage)
        while True:
            r = self.next_chunk(planner is not None)
            plan = planner(r.vis) if planner else None
            rows = slice(-1, None) if r.last else slice(None)
            out = yield from self.model.forward_steps(
                r.tokens, r.positions, r.cache, r.vis, rows, plan, argmax=self.sampling.plain
            )
            token = self.chunk_done(out)
            if token is not None:
                return token

    def begin_prompt(self, prompt_ids: list[int], capacity: int, storage: torch.Tensor | None = None) -> None:
        """A new prompt: the cache kept to the prefix it shares with the last generation's text (or a new one), and
        the rest of the prompt to prefill a chunk at a time (`next_chunk`, `chunk_done`): in forwards of its own,
        or riding in a batch's forwards beside other generations' trees (`many_steps`)."""
        c, keep, every = self.cache, 0, self.sampling.prompt_logprobs  # `every`: each prompt row's logits wanted
        c = None if c is not None and c.whole else c  # a forward that never committed left its states past its text
        if c is not None and c.capacity >= capacity and (storage is None or storage.data_ptr() == c.k.data_ptr()):
            keep = next(
                (i for i, (a, b) in enumerate(zip(self.tokens, prompt_ids)) if a != b),
                min(len(self.tokens), len(prompt_ids)),
            )
            keep = min(keep, len(prompt_ids) - 1, c.length)  # the last prompt token runs again: its logits are needed
            keep = keep if c.can_rewind(keep) and not every else 0  # a sliding layer may have dropped rows it needs
        if self.prefixes is not None and c is not None and c.length - keep >= MIN_TOKENS:
            self.prefixes.keep(self.tokens, c)  # the rows this prompt does not continue outlive the cache
        if keep > 0:
            c.rewind(keep)
        else:
            self.cache = c = None  # the old cache freed first: the plan counts one cache a slot, never two at once
            self.cache = c = self.model.new_cache(capacity, storage)
            if storage is not None:  # over a range an older cache used (a batch slot's own, kept): its states start
                c.state.zero_()  # from zeros, as a cache of its own does (its rows are written before they are read)
        if self.prefixes is not None and not every and keep < len(prompt_ids) - 1:  # else nothing is left to find
            keep = self.prefixes.take(prompt_ids, c, keep)
        self.tokens, self.reused = list(prompt_ids), keep
        self.prompt_logprobs = [None] if every else None
        self.constraint = Constraint.of(
            self.sampling, source_of(self.model), self.model.args.vocab_size, len(prompt_ids)
        )
        n = PROMPT_LOGPROBS_CHUNK if every else PREFILL_CHUNK  # every row's logits: a chunk's fit its activations
        self.chunks = [prompt_ids[s : s + n] for s in range(keep, len(prompt_ids), n)]

    @property
    def prefilling(self) -> bool:
        """Part of the prompt is still to prefill."""
        return bool(self.chunks)

    def next_chunk(self, explicit: bool = False) -> Rows:
        """The prompt's next chunk's rows (only the last row's output wanted). `explicit`: with its causal
        visibility spelled out (a planner splits it)."""
        c, dev = self.cache, self.model.device
        c.whole = True  # every row of a prompt's chunk is kept
        chunk = torch.tensor(self.chunks[0], device=dev)
        pos = torch.arange(c.length, c.length + len(chunk), device=dev)
        vis = Visibility.causal(c.end, len(chunk)) if explicit else None
        return Rows(chunk, pos, c, vis, last=self.prompt_logprobs is None)

    def chunk_done(self, out: torch.Tensor) -> int | None:
        """A chunk's forward done: its rows committed; after the last, the first generated token (from its last
        row's output), else None. Where the prompt's log-probabilities are asked for, each of its rows gives the
        next prompt token's."""
        self.cache.commit()
        chunk = self.chunks.pop(0)
        if self.prompt_logprobs is not None:
            at = self.cache.length  # the first prompt token after this chunk
            follow = chunk[1:] + self.tokens[at : at + 1]
            top = self.sampling.logprobs
            self.prompt_logprobs += [token_logprobs(out[j], t, top) for j, t in enumerate(follow)]
        return None if self.chunks else self._next(out[-1])

    def step_steps(self, root: int):
        """A plain decode step on the root."""
        c, dev = self.cache, self.model.device
        c.whole = True  # the step's row is kept
        out = yield from self.model.forward_steps(
            torch.tensor([root], device=dev), torch.tensor([c.length], device=dev), c, argmax=self.sampling.plain
        )
        c.commit()
        self.tokens.append(root)
        return self._next(out[0])

    def _next(self, row: torch.Tensor) -> int:
        """The token after the text so far from its row: the pass gave it where the choice is plain (`argmax`), else
        chosen from the row's logits with the text's penalties, its position's draw and the grammar's mask."""
        if self.sampling.plain:
            return int(row)
        token = self._choose(row, self.tokens)
        if self.sampling.logprobs >= 0:
            self.logprobs.append(token_logprobs(row, token, self.sampling.logprobs))
        return token

    def _choose(self, row: torch.Tensor, text: list[int]) -> int:
        allowed = self.constraint.allowed(text) if self.constraint is not None else None
        return choose(row, self.sampling, text, allowed)

    def take_logprobs(self) -> dict:
        """{"logprobs": the tokens chosen since the last call, each [id, log-probability, [[id, log-probability] of
        the likeliest `sampling.logprobs`]] (models/sampling.py `token_logprobs`)}, and the first time after a prompt
        whose log-probabilities were asked for, {"prompt_logprobs": its tokens' (the first's None)}."""
        out, self.logprobs = {"logprobs": self.logprobs}, []
        if self.prompt_logprobs is not None:
            out["prompt_logprobs"], self.prompt_logprobs = self.prompt_logprobs, None
        return out

    def tree_rows(self, tree: TokenTree) -> tuple[list[int], Rows]:
        """[root] + the tree's tokens, and its rows for a forward: their positions past the cache, each row
        seeing the committed text and its own ancestors."""
        c, dev = self.cache, self.model.device
        tokens, parents, depths = tree.flatten()
        pos = torch.tensor(depths, device=dev) + c.length
        return tokens, Rows(torch.tensor(tokens, device=dev), pos, c, Visibility.tree(c.length, parents))

    def verify_steps(self, tree: TokenTree, planner=None):
        """One forward over [root] + the tree, acceptance, and the cache kept to the accepted path."""
        tokens, r = self.tree_rows(tree)
        out = yield from self.model.forward_steps(
            r.tokens,
            r.positions,
            r.cache,
            r.vis,
            plan=planner(r.vis) if planner else None,
            argmax=self.sampling.plain,  # each row's token (never the [rows, vocabulary] logits)
        )
        return self.settle(tree, tokens, out)

    def settle(self, tree: TokenTree, tokens: list[int], out: torch.Tensor) -> Verdict:
        """The verdict on a tree from its forward's output (each row's token where the choice is plain, else its
        logits), and the cache and the text kept to the accepted path. A node is accepted where its token is the
        target's choice after its parent's row: with penalties, a draw or a grammar, the choice that row's own text
        and position give (only the rows along the accepted path are chosen)."""
        c = self.cache
        if self.sampling.plain:
            choice = out.tolist()
            path, nxt = longest_accepted_path(tree, lambda row: choice[row])
        else:
            text = self.tokens + [tokens[0]]
            row_text = lambda row: text if row == 0 else text + tree.tokens_of(tree.path(row - 1))
            path, nxt = longest_accepted_path(tree, lambda row: self._choose(out[row], row_text(row)))
            if self.sampling.logprobs >= 0:  # each committed token's, from the row that chose it
                new = [tokens[i + 1] for i in path] + [nxt]
                rows = [0] + [i + 1 for i in path]
                self.logprobs += [token_logprobs(out[r], t, self.sampling.logprobs) for r, t in zip(rows, new)]
        c.commit([0] + [i + 1 for i in path])  # the root and the accepted nodes, in order
        self.tokens += [tokens[0]] + [tokens[i + 1] for i in path]
        return Verdict(path, nxt, len(tokens))

    # -- the same jobs with every weight at hand -----------------------------------------------

    def start(self, prompt_ids: list[int], capacity: int) -> int:
        return drive(self.start_steps(prompt_ids, capacity), self.model.weights)

    def step(self, root: int) -> int:
        return drive(self.step_steps(root), self.model.weights)

    def verify_tree(self, tree: TokenTree) -> Verdict:
        return drive(self.verify_steps(tree), self.model.weights)


class Prefill(NamedTuple):
    """A prompt to prefill, as a batch's job (`many_steps`): its next chunk rides in the batch's forward. A new
    prompt begins at its first (`Verifier.begin_prompt`, by whoever made the verifier); the job gives None until
    its last chunk gives the first token."""

    prompt_ids: list[int]
    capacity: int


def many_steps(jobs: list[tuple["Verifier", object]]):
    """Several generations' cycles in one forward (models/batch.py: the linear layers over all their rows, each
    one's attention over its own cache): a streamed layer is read once for all of them. A job is (its verifier, a
    `Prefill`, a root token for a plain step or a `TokenTree` to verify); each gets
    what its own `start_steps`, `step_steps` or `verify_steps` would return (a token, a `Verdict`), with the same
    bits: its rows are computed as they would be alone. A prompt longer than a chunk prefills its first chunks
    alone, its last with the batch. Returns them in order."""
    if not jobs:
        return []
    model = jobs[0][0].model
    if any(v.model is not model for v, _ in jobs):
        raise CadenceError("a batch of generations takes generations of one target model")
    rows, parts = [], []
    for v, what in jobs:
        if isinstance(what, Prefill):
            r, tokens = v.next_chunk(), None
        elif isinstance(what, TokenTree):
            tokens, r = v.tree_rows(what)
        else:
            c, dev = v.cache, model.device
            c.whole = True  # a plain step's row is kept
            tokens, r = [what], Rows(torch.tensor([what], device=dev), torch.tensor([c.length], device=dev), c)
        rows.append(tokens)
        parts.append(r)
    plain = all(v.sampling.plain for v, _ in jobs)  # else logits, and each plain one takes its argmax
    outs = yield from forward_many_steps(model, parts, argmax=plain)
    done = []
    for (v, what), tokens, out in zip(jobs, rows, outs):
        if v.sampling.plain and not plain:
            out = out.argmax(-1)
        if isinstance(what, Prefill):
            done.append(v.chunk_done(out))
        elif isinstance(what, TokenTree):
            done.append(v.settle(what, tokens, out))
        else:
            v.cache.commit()
            v.tokens.append(what)
            done.append(v._next(out[0]))
    return done


def verify_many(jobs: list[tuple[Verifier, TokenTree]]) -> list[Verdict]:
    """Generations' trees verified in one forward, every weight at hand."""
    return drive(many_steps(jobs), jobs[0][0].model.weights) if jobs else []


class LocalTarget:
    """The target side of the speculation cycle (speculative/loop.py) with the model in this process."""

    streamed = False
    io_wait = None

    def __init__(self, model: Transformer, prefixes: PrefixCache | None = None):
        self.model, self.prefixes = model, prefixes
        self.verifier: Verifier | None = None

    def start(
        self, prompt_ids: list[int], capacity: int, sampling: SamplingConfig, reuse: bool = True
    ) -> tuple[int, int]:
        """Prefill; the last generation's cache is kept where this prompt continues its text, or the prompt cache's
        longest prefix of it restored (`reuse`)."""
        self.verifier = Verifier(
            self.model, sampling, self.verifier if reuse else None, self.prefixes if reuse else None
        )
        return self.verifier.start(prompt_ids, capacity), self.verifier.reused

    def step(self, root: int) -> int:
        return self.verifier.step(root)

    def verify(self, p: Proposal) -> tuple[list[int], int]:
        v = self.verifier.verify_tree(TokenTree.of(p.tree))
        return v.path, v.next_token

    def take_stats(self) -> dict:
        """The generation's tokens' log-probabilities, where asked for."""
        v = self.verifier
        return v.take_logprobs() if v is not None and v.sampling.logprobs >= 0 else {}
