"""The draft side: a small model kept in step with the committed text, growing token trees.

`Drafter` composes what drafting takes, each part with its own state: the draft model's KV cache and its
forwards (speculative/feed.py `DraftFeed`: the committed text but a pending tail, the tree's nodes); how the
tree grows from the distributions those forwards give (greedy with `growth` best: best first,
speculative/bestfirst.py; else LLMCad's branch pacer with its self-adaptive fallback, or a fixed ARCA shape,
speculative/growth.py); drafting during verification and what the next tree reuses of it (speculative/ahead.py
`DraftingAhead`). The Drafter itself keeps the committed text and its trie (Lookahead's candidates) and takes
the verdicts.
"""

from __future__ import annotations

from common.modes import Mode
from common.settings import SamplingConfig, TreeConfig
from models.transformer import Transformer
from speculative.ahead import DraftingAhead
from speculative.bestfirst import grow_best_first
from speculative.feed import DraftFeed, run_here
from speculative.growth import PacedGrowth, fill_shape
from speculative.sides import Proposal
from speculative.policy import AdaptiveThreshold
from speculative.tree import ROOT, DraftTree, TokenTree
from speculative.trie import TokenTrie, grammar_keep


class Drafter:
    def __init__(self, model: Transformer, sampling: SamplingConfig, cfg: TreeConfig):
        self.cfg = cfg
        self.feed = DraftFeed(model, sampling)
        self.threshold = AdaptiveThreshold(cfg.alpha)  # the pacer's fallback; the verdicts adapt it
        self.pacer = PacedGrowth(cfg, self.threshold)
        self.ahead = DraftingAhead(self.feed, cfg, sampling.plain)
        self.trie = TokenTrie() if cfg.trie and cfg.mode is Mode.TREE else None
        self.context: list[int] = []  # every committed token: what the trie matches against
        self.forced = 0  # tokens planted because a grammar allowed them alone (each certain: always accepted)

    @property
    def cache(self):
        return self.feed.cache

    @property
    def pending(self) -> list[int]:
        return self.feed.pending

    @property
    def skipped(self) -> int:
        return self.feed.skipped

    @property
    def ahead_steps(self) -> int:
        return self.ahead.steps

    @property
    def ahead_reused(self) -> int:
        return self.ahead.reused

    def start(self, prompt_ids: list[int], capacity: int):
        """Take the prompt (fed with the first tree, its last `prompt_window` tokens: `DraftFeed.start`); the
        first generated token arrives through `push`."""
        self.feed.start(prompt_ids, capacity, self.cfg.prompt_window)
        self.ahead.discard()
        self.context = self.feed.text = list(prompt_ids)  # the feed's rows score their tokens after this text
        if self.trie:
            self.trie.insert(self.context)

    def push(self, tokens: list[int]):
        """Committed tokens the draft has not seen yet (the first generated token)."""
        self.feed.push(tokens)
        self._remember(tokens)

    def _remember(self, tokens: list[int]):
        self.context.extend(tokens)
        if self.trie:
            self.trie.insert(self.context, start=len(self.context) - len(tokens) - self.trie.branch_len + 1)

    def _add_trie(self, d: DraftTree, room: int):
        """The trie's candidates (Lookahead decoding) for the root's continuation."""
        got = self.trie.retrieve(
            self.context, min(room, self.cfg.trie_nodes), keep=grammar_keep(self.feed.constraint, self.context)
        )
        index = {}
        for i, (tok, parent, p) in enumerate(zip(got.tokens, got.parents, got.probs)):
            at = index[parent] if parent >= 0 else ROOT
            index[i] = d.tree.add(tok, at, p)
        d.trie_nodes = len(got.tokens)

    def lookup(self, max_nodes: int) -> DraftTree | None:
        """Prompt lookup: a tree of the trie's candidates alone (n-grams of the prompt and the output
        that continue the text), with no draft forward; None when the trie has none. The draft has
        not run on any of it, so the verdict is taken like a plain step's (`advance(None, ...)`)."""
        if self.trie is None:
            return None
        d = DraftTree(TokenTree(self.context[-1]), 1.0, 0)
        self._add_trie(d, max_nodes)
        return d if d.trie_nodes else None

    def build_static(self, budget: int) -> DraftTree:
        """Fill an ARCA tree shape level by level: one draft forward per level, all its nodes at once."""
        d = DraftTree(TokenTree(self.feed.pending[-1]), 1.0, 1)
        dist, d.catchup_s = self.feed.feed_pending()
        fill_shape(d, dist, self.cfg, budget, self.feed)
        return d

    def build_tree(self, budget: int | None = None) -> DraftTree:
        """`build_tree_steps` with its draft forwards run here."""
        return run_here(self.build_tree_steps(budget), self.feed.model)

    def build_tree_steps(self, budget: int | None = None):
        """Grow a tree of at most `budget` tokens (default: the verification width) under the root: the pending
        tail fed (or, where a chain drafted during the last verification was reused, the root and the chain
        below it fed already), the trie's candidates, then the growth policy's draft forwards. A generator of the
        tree's draft forwards (speculative/feed.py `run_here`; an ARCA shape runs its own at once)."""
        cfg = self.cfg
        budget = cfg.budget if budget is None else budget
        forced = self._forced(budget)
        if cfg.shape_parents and not forced:  # a fixed shape has no place for a forced run
            return self.build_static(budget)
        seed = self.ahead.take_seed()
        best = cfg.mode is Mode.TREE and cfg.growth == "best"
        if seed is not None and not self.feed.pending:
            d = DraftTree(TokenTree(self.context[-1]), 1.0, 0)
            dist = seed.root_dist
        else:
            d = DraftTree(TokenTree(self.feed.pending[-1]), 1.0, 1)
            dist, d.catchup_s = yield from self.feed.feed_pending_steps()
            seed = None
        at = ROOT
        if forced:  # the grammar allows one run only: planted whole, one forward for all of it, no trie
            at, dist = yield from self._plant(d, forced)
        elif self.trie and budget > 1:
            self._add_trie(d, budget - 1)
        if best:
            planted = self.ahead.plant(d, seed, dist, budget) if seed is not None else []
            yield from grow_best_first(d, [(at, dist), *planted], budget, cfg, self.feed)
            return d
        self.pacer.expand(d, at, dist, budget - len(d.tree))
        if seed is not None:
            self.ahead.plant(d, seed, dist, budget, self.pacer.expand)
        yield from self.pacer.grow(d, budget, self.feed)
        return d

    def _forced(self, budget: int) -> list[int]:
        """The run of tokens a grammar allows alone after the text (none without one), at most `budget`."""
        c = self.feed.constraint
        return c.forced(self.context)[:budget] if c is not None else []

    def _plant(self, d: DraftTree, run: list[int]):
        """A forced run as a chain under the root (each node certain: the target's masked choice can be no other),
        the draft run on all of it in one forward: (its last node, that node's next-token distribution)."""
        at = d.tree.chain(run)
        dists = yield from self.feed.feed_nodes_steps(d.tree, list(range(len(run))))
        d.forwards += 1
        self.forced += len(run)
        return at, dists[-1]

    def draft_ahead(self, d: DraftTree | None, steps: int, stop=lambda: False) -> int:
        """Speculative drafting during verification (LLMCad 3.4, `DraftingAhead.draft`): the forwards run."""
        return self.ahead.draft(d, steps, stop)

    def advance(self, d: DraftTree | None, path: list[int], new_tokens: list[int]):
        """After a verification: keep the accepted nodes the draft already ran on; the rest is pending.

        With a chain drafted ahead from the accepted leaf whose first token is the target's own next token,
        that token becomes the root already fed, and the rest of the chain seeds the next tree."""
        self._remember(new_tokens)
        if d is None:
            self.ahead.discard()
            self.feed.commit([])
            self.feed.push(new_tokens)
            return
        t = d.tree
        fed = [t.nodes[i].slot for i in path if t.nodes[i].fed]  # the tree's build fed every pending token
        slots, n, held = self.ahead.settle(t, path, new_tokens)
        self.feed.commit(fed + slots, held)  # pending slots were filled in feed order: the accepted ones, in order
        self.feed.push(new_tokens[len(fed) + n :])

    def update_threshold(self, d: DraftTree, path: list[int]):
        """The fallback's alpha after a verdict that accepted `path` of `d` (tree mode only)."""
        if self.cfg.mode is Mode.TREE:
            self.threshold.take(d.tc, d.tree, path)


PROMPT_ROWS = 32  # a forward of more rows than this ran over a prompt (a tree's catch-up feeds a few)


class LocalDraft:
    """The draft side of the speculation cycle (speculative/loop.py) with the draft model in this process;
    the draft actor (actors/draft.py) runs it too, so what the draft does with a verdict is written once."""

    has_model = True

    def __init__(self, model: Transformer):
        self.model = model
        self.drafter: Drafter | None = None

    def start(self, prompt_ids: list[int], capacity: int, first: int, cfg: TreeConfig, sampling: SamplingConfig):
        self.take_stats()  # what a generation stopped early left untaken is not this one's
        self.drafter = Drafter(self.model, sampling, cfg)
        self.drafter.start(prompt_ids, capacity)
        self.drafter.push([first])

    def propose(self, budget: int, ahead: int = 0) -> Proposal | None:
        """A tree of at most `budget` tokens; then (in this process, before the verification, not beside it) up to
        `ahead` draft forwards on from it."""
        p = self._proposal(self.drafter.build_tree(budget))
        if ahead and p is not None and p.tokens:
            self.ahead(p, ahead)
        return p

    @staticmethod
    def propose_many(asks: list[tuple["LocalDraft", int, int]]) -> list[Proposal | None]:
        """Several generations' trees (each its draft side, budget and forwards ahead) grown together, their draft
        forwards shared (speculative/draft_batch.py); each tree the one its `propose` grows alone."""
        from speculative.draft_batch import grow_together, shares_forwards

        drafts = [d for d, _, _ in asks]
        if len(drafts) < 2 or any(d.model is not drafts[0].model for d in drafts):
            return [d.propose(b, a) for d, b, a in asks]
        trees = grow_together(drafts[0].model, [d.drafter.build_tree_steps(b) for d, b, _ in asks])
        if shares_forwards(drafts[0].model):  # their catch-ups were one forward: each its share
            caught = [t for t in trees if t is not None and t.catchup_s > 0]
            for t in caught:
                t.catchup_s /= len(caught)
        out = [d._proposal(t) for d, t in zip(drafts, trees)]
        for (d, _, a), p in zip(asks, out):
            if a and p is not None and p.tokens:
                d.ahead(p, a)
        return out

    def lookup(self, max_nodes: int) -> Proposal | None:
        """The trie's candidates alone: the draft runs on none of them."""
        return self._proposal(self.drafter.lookup(max_nodes), drafted=False)

    @staticmethod
    def _proposal(d: DraftTree | None, drafted: bool = True) -> Proposal | None:
        """The tree as the target side takes it."""
        if d is None:
            return None
        return Proposal(d.tree.proposal(d.tc, d.forwards, d.trie_nodes, d.catchup_s), drafted, d)

    def ahead(self, p: Proposal | None, steps: int, stop=lambda: False) -> int:
        """Draft on from the tree until `stop()` (in the draft actor: until the verdict arrives)."""
        return self.drafter.draft_ahead(p.draft if p is not None else None, steps, stop)

    def advance(self, p: Proposal | None, path: list[int], new: list[int]) -> float:
        """Keep the accepted nodes the draft ran on; adapt the fallback threshold to the verdict."""
        d = p.draft if p is not None else None
        self.drafter.advance(d, path, new)
        if d is not None:
            self.drafter.update_threshold(d, path)
        return self.drafter.threshold.alpha

    def fed_prompt(self) -> bool:
        """Whether the draft ran over a prompt since the last call (a forward of more than PROMPT_ROWS rows)."""
        return self.drafter.feed.take_fed() > PROMPT_ROWS

    def ahead_counts(self) -> tuple[int, int]:
        return self.drafter.ahead_steps, self.drafter.ahead_reused

    def take_stats(self) -> dict:
        """Since the last call: the tokens a grammar forced, and a flash draft's reads (flash/weights.py
        `FlashStats`)."""
        out = {}
        if self.drafter is not None and self.drafter.forced:
            out["forced"], self.drafter.forced = self.drafter.forced, 0
        weights = self.model.weights
        if hasattr(weights, "reset_stats"):
            out["draft_flash"] = weights.stats.as_dict()
            weights.reset_stats()
        return out
