"""The draft model kept in step with the committed text: its KV cache and every forward the draft runs.

The committed text is in the cache except for a tail of `pending` tokens (at least the root, the newest token).
`feed_pending` runs the draft on that tail; `feed_nodes` on tree nodes, each row seeing the committed text and its
own ancestors' KV slots (LLMCad's tree decoder); `feed_chain` on a node outside any tree (the chain drafted
during verification, speculative/ahead.py). After a verdict `commit` keeps the accepted entries. What the draft
then grows from the distributions these return is decided elsewhere (speculative/growth.py, bestfirst.py).
"""

from __future__ import annotations

import time

import torch

from common.settings import CATCH_UP, SamplingConfig
from models.attention import Visibility
from models.batch import Rows
from speculative.grammar import Constraint, source_of
from models.sampling import CANDIDATES, scores
from models.transformer import Transformer
from speculative.tree import TokenTree


class DraftFeed:
    def __init__(self, model: Transformer, sampling: SamplingConfig):
        self.model, self.sampling = model, sampling
        self.text: list[int] = []  # every committed token, prompt included (the drafter's, kept in step by it)
        self.cache = None
        self.pending: list[int] = []  # committed tokens the draft has not run on (the last is the root)
        self.skipped = 0  # committed tokens the draft never ran on (the prompt's window, a catch-up)
        self.fed = 0  # rows of the last forward over pending tokens (the prompt's, the first time)
        self.constraint: Constraint | None = None  # the sampling's grammar (its mask on every row the draft scores)

    def start(self, prompt_ids: list[int], capacity: int, window: int) -> None:
        """A new cache; the prompt's last `window` tokens (0: all of it) pending, fed with the first tree.

        The draft runs on the prompt's last `prompt_window` tokens only. Its prefill costs what a
        target step of as many rows costs per row (the int kernels grow linearly with rows on a
        CPU), and the governor pays it on its first try of a draft budget: on a long prompt that
        try would cost more than speculation wins back. The draft guesses from the recent text,
        the trie still matches the whole prompt, and the target decides every token."""
        self.cache = None  # the last prompt's cache freed before the new one is made (never two held at once)
        self.cache = self.model.new_cache(capacity)
        self.pending = list(prompt_ids[-window:]) if window else list(prompt_ids)
        self.skipped = len(prompt_ids) - len(self.pending)
        self.constraint = Constraint.of(
            self.sampling, source_of(self.model), self.model.args.vocab_size, len(prompt_ids)
        )

    def push(self, tokens: list[int]) -> None:
        """Committed tokens the draft has not run on."""
        self.pending.extend(tokens)

    @property
    def length(self) -> int:
        """Committed entries in the cache (the next ones are the pending slots, in the order they were fed)."""
        return self.cache.length

    @property
    def room(self) -> int:
        """Slots left in the cache."""
        return self.cache.capacity - self.cache.end

    def take_fed(self) -> int:
        """Rows of the last forward over pending tokens since the last call (0: none)."""
        fed, self.fed = self.fed, 0
        return fed

    def feed_pending(self) -> tuple[torch.Tensor, float]:
        """`feed_pending_steps` with its forward run here."""
        return run_here(self.feed_pending_steps(), self.model)

    def feed_pending_steps(self):
        """Run the draft on the committed tokens it has not seen: (the root's next-token distribution, the
        forward's seconds where it was a catch-up, else 0). A generator: it yields its forward's `Rows` and is sent
        their logits (`run_here` runs it at once; speculative/draft_batch.py shares it with other caches' rows).

        Behind by more than CATCH_UP tokens after plain target steps (the governor found that
        speculation did not pay), it runs on the last CATCH_UP only: a forward over all of them
        would cost more than the try it serves can win back. Its context then has a hole, closed
        up (positions run on from the cache), which only makes its guesses a little worse: the
        target still decides every token. (The prompt is cut the same way, in `start`.)"""
        c, dev = self.cache, self.model.device
        if c.length and len(self.pending) > CATCH_UP:
            self.skipped += len(self.pending) - CATCH_UP
            self.pending = self.pending[-CATCH_UP:]
        ids = torch.tensor(self.pending, device=dev)
        t0 = time.perf_counter()
        logits = (yield Rows(ids, torch.arange(c.length, c.length + len(ids), device=dev), c, last=True))[0]
        c.commit()
        # more rows than a verification leaves (its bonus token, an accepted node not fed): a catch-up, not a
        # draft step (the governor prices a budget by what its steps cost)
        catchup_s = time.perf_counter() - t0 if len(ids) > 2 else 0.0
        self.fed = len(ids)
        self.pending = []
        return self._dist(logits, self.text), catchup_s

    def feed_nodes(self, tree: TokenTree, nodes: list[int]) -> list[torch.Tensor]:
        """`feed_nodes_steps` with its forward run here."""
        return run_here(self.feed_nodes_steps(tree, nodes), self.model)

    def feed_nodes_steps(self, tree: TokenTree, nodes: list[int]):
        """One draft forward over tree `nodes` (their ancestors fed already, or among `nodes` before them): each row
        sees the committed text, its ancestors' KV slots and its own new one. Marks them fed, each with its slot;
        their next-token distributions. A generator like `feed_pending_steps`."""
        t, end = tree, self.cache.end
        new = {n: end + j for j, n in enumerate(nodes)}  # the slots this forward gives them (`_forward`)
        ancestors = [[new.get(a, t.nodes[a].slot) for a in t.path(n)[:-1]] for n in nodes]
        slots, logits = yield from self._forward(
            [t.nodes[n].token for n in nodes], [t.nodes[n].depth for n in nodes], ancestors
        )
        dists = []
        for j, node in enumerate(nodes):
            t.nodes[node].fed, t.nodes[node].slot = True, slots[j]
            dists.append(
                self._dist(logits[j], self.text + t.tokens_of(t.path(node)) if not self.sampling.plain else ())
            )
        return dists

    def feed_chain(self, token: int, depth: int, anc_slots: list[int]) -> tuple[int, torch.Tensor]:
        """One draft forward of a node at `depth` under the ancestors in `anc_slots`, in no tree: its slot and
        next-token distribution."""
        slots, logits = run_here(self._forward([token], [depth], [anc_slots]), self.model)
        return slots[0], self._dist(logits[0], ())

    def _forward(
        self, tokens: list[int], depths: list[int], ancestors: list[list[int]]
    ) -> tuple[list[int], torch.Tensor]:
        """Rows of `tokens` at `depths` below the root, each seeing the committed text, its `ancestors`' slots
        and its own new slot (the tree decoder's mask): (their slots, logits [rows, vocab]). A generator: yields
        the forward's `Rows`, is sent their logits."""
        c, dev = self.cache, self.model.device
        end, ptr, rows = c.end, [0], []
        for j, anc in enumerate(ancestors):
            rows += anc + [end + j]
            ptr.append(len(rows))
        vis = Visibility(c.length, torch.tensor(ptr, dtype=torch.int32), torch.tensor(rows, dtype=torch.int32))
        pos = torch.tensor([c.length + depth - 1 for depth in depths], device=dev)
        logits = yield Rows(torch.tensor(tokens, device=dev), pos, c, vis)
        return [end + j for j in range(len(tokens))], logits

    def _dist(self, logits: torch.Tensor, text) -> torch.Tensor:
        """How likely each token is the target's choice after `text` (every committed token, then the node's
        path): the softmax of the logits where that choice is the plain argmax, else of the scores it will be the
        argmax of (the same penalties on the same text, the same draw at the same position, the same grammar's mask:
        models/sampling.py).
        A draft with a cut head gives logits for the tokens below its `head_rows` only, and its candidates are
        among them (a tree's distributions 64 KB a node, not 600). Where the grammar allows none of those, the
        row is all zeros: no candidate (a softmax over nothing is NaN, which would plant forbidden tokens and price
        every draft budget at NaN)."""
        if self.sampling.plain:
            return torch.softmax(logits.float(), -1)
        allowed = self.constraint.allowed(text) if self.constraint is not None else None
        return torch.softmax(scores(logits, self.sampling, text, CANDIDATES, allowed), -1).float().nan_to_num_(0.0)

    def commit(self, slots: list[int], held: int = 0) -> None:
        """After a verdict: keep the entries of the pending `slots` (ascending, in the text's order), drop the
        rest; the last `held` of them stay pending, fed already, for the next tree (a chain drafted ahead)."""
        c = self.cache
        L = c.length
        c.commit([slot - L for slot in slots])
        if held:
            c.length -= held
            c.pending = held


def run_here(steps, model: Transformer):
    """A draft generator (`DraftFeed.feed_pending_steps`, `feed_nodes_steps`, `Drafter.build_tree_steps`) with each
    forward it yields run at once on `model`, a forward of its own: what it returns."""
    try:
        rows = next(steps)
        while True:
            logits_rows = slice(-1, None) if rows.last else None
            rows = steps.send(model.forward(rows.tokens, rows.positions, rows.cache, rows.vis, logits_rows=logits_rows))
    except StopIteration as done:
        return done.value
