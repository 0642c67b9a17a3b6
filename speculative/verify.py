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
from models.kvcache import KVCache
from common.settings import PREFILL_CHUNK
from models.grammar import Constraint, source_of
from models.sampling import choose, token_logprobs
from common.settings import SamplingConfig
from models.transformer import Transformer
from models.weights import drive
from speculative.loop import Proposal
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
        self.tokens: list[int] = (
            list(previous.tokens) if previous is not None else []
        )  # what the cache holds, committed
        self.reused = 0  # prompt tokens the last start found in the cache
        self.chunks: list[list[int]] = []  # the prompt's chunks still to prefill
        self.constraint: Constraint | None = None  # the sampling's grammar, over what follows the prompt
        self.logprobs: list = []  # where asked for: each token chosen since the last take, with its log-probabilities

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
            out = yield from self.model.forward_steps(
                r.tokens, r.positions, r.cache, r.vis, slice(-1, None), plan, argmax=self.sampling.plain
            )
            token = self.chunk_done(out)
            if token is not None:
                return token

    def begin_prompt(self, prompt_ids: list[int], capacity: int, storage: torch.Tensor | None = None) -> None:
        """A new prompt: the cache kept to the prefix it shares with the last generation's text (or a new one), and
        the rest of the prompt to prefill a chunk at a time (`next_chunk`, `chunk_done`): in forwards of its own,
        or riding in a batch's forwards beside other generations' trees (`many_steps`)."""
        c, keep = self.cache, 0
        if c is not None and c.capacity >= capacity and (storage is None or storage.data_ptr() == c.k.data_ptr()):
            keep = next(
                (i for i, (a, b) in enumerate(zip(self.tokens, prompt_ids)) if a != b),
                min(len(self.tokens), len(prompt_ids)),
            )
            keep = min(keep, len(prompt_ids) - 1, c.length)  # the last prompt token runs again: its logits are needed
            keep = keep if c.can_rewind(keep) else 0  # a sliding-window layer may have dropped rows it needs
        if self.prefixes is not None and c is not None and c.length - keep >= MIN_TOKENS:
            self.prefixes.keep(self.tokens, c)  # the rows this prompt does not continue outlive the cache
        if keep > 0:
            c.rewind(keep)
        else:
            self.cache = c = self.model.new_cache(capacity, storage)
        if self.prefixes is not None:
            keep = self.prefixes.take(prompt_ids, c, keep)
        self.tokens, self.reused = list(prompt_ids), keep
        self.constraint = Constraint.of(
            self.sampling, source_of(self.model), self.model.args.vocab_size, len(prompt_ids)
        )
        self.chunks = [prompt_ids[s : s + PREFILL_CHUNK] for s in range(keep, len(prompt_ids), PREFILL_CHUNK)]

    @property
    def prefilling(self) -> bool:
        """Part of the prompt is still to prefill."""
        return bool(self.chunks)

    def next_chunk(self, explicit: bool = False) -> Rows:
        """The prompt's next chunk's rows (only the last row's output wanted). `explicit`: with its causal
        visibility spelled out (a planner splits it)."""
        c, dev = self.cache, self.model.device
        chunk = torch.tensor(self.chunks[0], device=dev)
        pos = torch.arange(c.length, c.length + len(chunk), device=dev)
        return Rows(chunk, pos, c, Visibility.causal(c.end, len(chunk)) if explicit else None, last=True)

    def chunk_done(self, out: torch.Tensor) -> int | None:
        """A chunk's forward done: its rows committed; after the last, the first generated token (from its last
        row's output), else None."""
        self.cache.commit()
        self.chunks.pop(0)
        return None if self.chunks else self._next(out[-1])

    def step_steps(self, root: int):
        """A plain decode step on the root."""
        c, dev = self.cache, self.model.device
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

    def take_logprobs(self) -> list:
        """The tokens chosen since the last call, each [id, log-probability, [[id, log-probability] of the likeliest
        `sampling.logprobs`]] (models/sampling.py `token_logprobs`)."""
        out, self.logprobs = self.logprobs, []
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
        return {"logprobs": v.take_logprobs()} if v is not None and v.sampling.logprobs >= 0 else {}


class LocalBatch:
    """The target side of a batch of generations (speculative/batch.py) with the model in this process: a
    verifier per slot, every slot's step or verification of a cycle in one forward."""

    streamed = False
    io_wait = None

    def __init__(self, model: Transformer, prefixes: PrefixCache | None = None):
        self.model = model
        self.slots = Slots(model, prefixes)

    def answer(self, calls: list) -> list:
        """Each (slot, `Call`) answered as `LocalTarget` would answer it alone: the prefills one by one, then every
        plain step and verification in one forward."""
        jobs = []
        for slot, call in calls:
            if call.kind == "start":
                prompt_ids, capacity, sampling, reuse, placed = call.args
                v = self.slots.begin(slot, prompt_ids, capacity, sampling, reuse, placed)
                jobs.append((v, Prefill(prompt_ids, capacity)))
            else:
                jobs.append(_job(self.slots.verifiers[slot], call))
        done = drive(many_steps(jobs), self.model.weights) if jobs else []
        return [
            (None if r is None else (r, v.reused)) if isinstance(w, Prefill) else reply(r)
            for (v, w), r in zip(jobs, done)
        ]

    def release(self, slot: int) -> None:
        """A generation cancelled: its slot's cache goes."""
        self.slots.verifiers.pop(slot, None)

    def take_stats(self, slot: int) -> dict:
        v = self.slots.verifiers.get(slot)
        return {"logprobs": v.take_logprobs()} if v is not None and v.sampling.logprobs >= 0 else {}


class Slots:
    """A batch's verifiers by slot, their caches in one arena (speculative/kvpool.py says where each goes), and the
    prompt cache that keeps what a new cache overwrites: the same in this process and in the verifier actor."""

    def __init__(self, model: Transformer, prefixes: PrefixCache | None = None):
        self.model, self.prefixes = model, prefixes
        self.verifiers: dict[int, Verifier] = {}
        self.pool = Arena(model)

    def begin(self, slot: int, prompt_ids, capacity: int, sampling, reuse: bool, placed) -> Verifier:
        """Slot's verifier for a prefill call: the one whose prompt is under way (its next chunk), else a new
        prompt's, in the range `placed` (a `Placed`, or its list over the wire; None: a cache of its own). The slot's
        last cache is continued where the slot kept its range (`reuse`); the idle caches the new range overwrites,
        and the slot's last one where it is not continued, go to the prompt cache first."""
        v = self.verifiers.get(slot)
        if v is not None and v.prefilling:
            return v
        kept = reuse and (placed is None or bool(placed[3]))
        storage = self.pool.view(placed, capacity)
        for s, old in list(self.verifiers.items()):
            if s == slot and kept:
                continue
            if s == slot or (storage is not None and old.cache is not None and _overlap(old.cache, storage)):
                if reuse and self.prefixes is not None:
                    self.prefixes.keep(old.tokens, old.cache)
                del self.verifiers[s]
        if storage is not None and not (placed[3] and kept):
            storage.zero_()  # a new cache starts as a cache of its own would, zeroed
        v = Verifier(self.model, sampling, self.verifiers.get(slot), self.prefixes if reuse else None)
        v.begin_prompt(list(prompt_ids), capacity, storage)
        self.verifiers[slot] = v
        return v


def _overlap(cache: KVCache, storage: torch.Tensor) -> bool:
    """Whether `cache` lives in memory `storage` covers (a range of the same arena)."""
    a0, b0 = cache.k.data_ptr(), storage.data_ptr()
    a1, b1 = a0 + KVCache.numel(cache.args, cache.capacity) * 4, b0 + storage.numel() * storage.element_size()
    same = cache.k.untyped_storage().data_ptr() == storage.untyped_storage().data_ptr()
    return same and a0 < b1 and b0 < a1


class Arena:
    """The memory of a batch's KV pool (speculative/kvpool.py decides where each cache goes): one array, made at the
    first start placed in it, each slot's cache a view of its range (its pages touched as a cache takes them)."""

    def __init__(self, model: Transformer):
        self.model, self.memory = model, None

    def view(self, placed, capacity: int) -> torch.Tensor | None:
        """The storage of a cache of `capacity` rows at `placed` (a `Placed`, or its list over the wire; None: a
        cache of its own), as it is (a new cache zeroes it)."""
        if placed is None:
            return None
        offset, total = int(placed[0]), int(placed[2])
        if self.memory is None or self.memory.numel() != total:
            self.memory = torch.empty(total, dtype=torch.float32, device=self.model.device)
        return self.memory[offset : offset + KVCache.numel(self.model.args, capacity)]


def _job(v: Verifier, call) -> tuple:
    """A step or verify `Call` as a `many_steps` job."""
    if call.kind == "step":
        return v, call.args[0]
    return v, TokenTree.of(call.args[0].tree)


def reply(r):
    """What a target side answers: a start's (token, reused), a step's token, a verification's (path, next token)."""
    return (r.path, r.next_token) if isinstance(r, Verdict) else r
