"""The draft side: a small model kept in step with the committed text, growing token trees.

`Drafter` owns the draft model's KV cache. The committed text is in that cache except for a
tail of `pending` tokens (at least the root, the newest token). `build_tree` feeds the pending
tail, then grows a tree by draft forwards, the tree attention mask letting each node see only its
own ancestors (LLMCad's tree decoder). Greedy with `growth` best, the tree grows best first
(speculative/bestfirst.py: the nodes of the greatest cumulative probability); else LLMCad's branch
pacer picks the tip and the tree stops growing when Tc falls below alpha or it reaches the width.
"""

from __future__ import annotations

import time

import torch

from common.settings import CATCH_UP, TOP_K, TreeConfig
from models.attention import Visibility
from models.sampling import Sampler, probs
from common.settings import SamplingConfig
from models.transformer import Transformer
from speculative.loop import Proposal
from speculative.policy import AdaptiveThreshold, branch_candidates, pace
from speculative.bestfirst import BestFirst
from speculative.ahead import DraftingAhead
from speculative.tree import ROOT, DraftTree, AheadChain, AheadSeed, TokenTree, best_branch
from speculative.trie import TokenTrie


class Drafter(DraftingAhead, BestFirst):
    def __init__(self, model: Transformer, sampling: SamplingConfig, cfg: TreeConfig):
        self.model, self.sampling, self.cfg = model, sampling, cfg
        self.sampler = Sampler(SamplingConfig(sampling.temperature, sampling.top_p, sampling.seed + 1))
        self.threshold = AdaptiveThreshold(cfg.alpha)
        self.trie = TokenTrie() if cfg.trie and cfg.mode == "tree" else None
        self.cache = None
        self.pending: list[int] = []
        self.context: list[int] = []  # every committed token: what the trie matches against
        self.ahead: AheadChain | None = None  # the chain drafted ahead of the tree under verification
        self.ahead_seed: AheadSeed | None = None  # a reused ahead chain, for the next tree
        self.ahead_steps = self.ahead_reused = 0  # forwards drafting ahead / tokens the next tree got from them
        self.skipped = 0  # committed tokens the draft never ran on (catch-up window)
        self.catchup_s = 0.0  # the last forward over pending tokens, when it was a catch-up (`_feed_pending`)
        self.fed = 0  # rows of the last forward over pending tokens (the prompt's, the first time)

    def start(self, prompt_ids: list[int], capacity: int):
        """Take the prompt (fed with the first tree); the first generated token arrives through `push`.

        The draft runs on the prompt's last `prompt_window` tokens only. Its prefill costs what a
        target step of as many rows costs per row (the int kernels grow linearly with rows on a
        CPU), and the governor pays it on its first try of a draft budget: on a long prompt that
        try would cost more than speculation wins back. The draft guesses from the recent text,
        the trie still matches the whole prompt, and the target decides every token."""
        self.cache = self.model.new_cache(capacity)
        self.ahead = self.ahead_seed = None
        w = self.cfg.prompt_window
        self.pending = list(prompt_ids[-w:]) if w else list(prompt_ids)
        self.skipped = len(prompt_ids) - len(self.pending)
        self.context = list(prompt_ids)
        if self.trie:
            self.trie.insert(self.context)

    def push(self, tokens: list[int]):
        """Committed tokens the draft has not seen yet (the first generated token)."""
        self.pending.extend(tokens)
        self._remember(tokens)

    def _remember(self, tokens: list[int]):
        self.context.extend(tokens)
        if self.trie:
            self.trie.insert(self.context, start=len(self.context) - len(tokens) - self.trie.branch_len + 1)

    def _feed_pending(self) -> torch.Tensor:
        """Run the draft on the committed tokens it has not seen; the root's next-token logits.

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
        logits = self.model.forward(
            ids, torch.arange(c.length, c.length + len(ids), device=dev), c, logits_rows=slice(-1, None)
        )[0]
        c.commit()
        # more rows than a verification leaves (its bonus token, an accepted node not fed): a catch-up, not a
        # draft step (the governor prices a budget by what its steps cost)
        self.catchup_s = time.perf_counter() - t0 if len(ids) > 2 else 0.0
        self.fed = len(ids)
        self.pending = []
        return logits

    def _dist(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution a draft token is chosen from (greedy: the plain softmax, as confidence). A draft
        with a cut head gives logits for the tokens below its `head_rows` only: greedy keeps that width (a
        tree's distributions 64 KB a node, not 600), sampling pads it to the vocabulary, whose distributions
        the verifier's acceptance test reads."""
        if self.sampling.greedy:
            return torch.softmax(logits.float(), -1)
        vocab = self.model.args.vocab_size
        if logits.shape[-1] < vocab:
            logits = torch.nn.functional.pad(logits, (0, vocab - logits.shape[-1]), value=float("-inf"))
        return probs(logits, self.sampling)

    def _feed_node(self, token: int, depth: int, anc_slots: list[int]) -> tuple[int, torch.Tensor]:
        """One draft forward of one tree node at `depth` that sees the committed text and its
        ancestors' KV slots (the tree decoder's mask); returns its slot and next-token distribution."""
        c, dev = self.cache, self.model.device
        slot = c.end
        vis = Visibility(
            c.length,
            torch.tensor([0, len(anc_slots) + 1], dtype=torch.int32),
            torch.tensor(anc_slots + [slot], dtype=torch.int32),
        )
        logits = self.model.forward(
            torch.tensor([token], device=dev), torch.tensor([c.length + depth - 1], device=dev), c, vis
        )[0]
        return slot, self._dist(logits)

    def _child(self, t: TokenTree, node: int, tok: int) -> int | None:
        return next((c for c in t.children(node) if t.nodes[c].token == tok), None)

    def _expand(self, d: DraftTree, node: int, dist: torch.Tensor, room: int):
        t = d.tree
        if self.sampling.greedy:
            top = torch.topk(dist, TOP_K)
            cands = list(zip(top.indices.tolist(), top.values.tolist()))
            if self.cfg.mode == "chain":
                cands = cands[:1]
            for tok, p in branch_candidates(cands, self.cfg.branch_threshold, TOP_K):
                c = self._child(t, node, tok)
                if c is not None:  # a trie candidate the model also proposes: trust the model's probability
                    self._reweigh(t, c, p)
                elif room > 0:
                    t.add(tok, node, p)
                    room -= 1
            return
        # Sampling: k i.i.d. draws from q, k fixed by q alone (how many candidates clear the threshold).
        # k is fixed before drawing, so that every draw is a trial whatever token it brings.
        k = 1 if self.cfg.mode == "chain" else max(1, int((dist >= self.cfg.branch_threshold).sum()))
        trials = d.trials.setdefault(node, [])
        for _ in range(min(k, room)):
            tok = self.sampler.draw(dist)
            child = self._child(t, node, tok)
            if child is None:
                child = t.add(tok, node, float(dist[tok]))
            trials.append((child, dist))

    def _reweigh(self, t: TokenTree, i: int, p: float):
        n = t.nodes[i]
        up = t.nodes[n.parent].cum if n.parent != ROOT else 1.0
        n.prob, n.cum = p, up * p
        stack = list(n.children)
        while stack:
            c = t.nodes[stack.pop()]
            c.cum = t.nodes[c.parent].cum * c.prob
            stack.extend(c.children)

    def _add_trie(self, d: DraftTree, room: int):
        """The trie's candidates (Lookahead decoding) for the root's continuation: deterministic (point-mass)
        trials."""
        got = self.trie.retrieve(self.context, max_nodes=min(room, self.cfg.trie_nodes))
        index = {}
        for i, (tok, parent, p) in enumerate(zip(got.tokens, got.parents, got.probs)):
            at = index[parent] if parent >= 0 else ROOT
            child = d.tree.add(tok, at, p)
            index[i] = child
            d.trials.setdefault(at, []).append((child, None))
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
        cfg, t0 = self.cfg, self.pending[-1]
        d = DraftTree(TokenTree(t0), 1.0, 1)
        dists = {ROOT: self._dist(self._feed_pending())}
        d.catchup_s = self.catchup_s
        index = {}  # shape node -> tree node
        level = [i for i, p in enumerate(cfg.shape_parents) if p < 0]
        while level:
            for i in level:
                if len(d.tree) >= budget:
                    break
                parent = index[cfg.shape_parents[i]] if cfg.shape_parents[i] >= 0 else ROOT
                dist = dists[parent]
                top = torch.topk(dist, cfg.shape_ranks[i] + 1)
                tok, p = int(top.indices[-1]), float(top.values[-1])
                index[i] = d.tree.add(tok, parent, p)
            nxt = [i for i, p in enumerate(cfg.shape_parents) if p in index and i not in index]
            feed = sorted({index[cfg.shape_parents[i]] for i in nxt})
            if not feed or len(d.tree) >= budget:
                break
            dists.update(zip(feed, self._feed_nodes(d, feed)))
            level = nxt
        d.tc = d.tree.tree_confidence()
        return d

    def build_tree(self, budget: int | None = None) -> DraftTree:
        """Grow a tree of at most `budget` tokens (default: the verification width) under the root."""
        if self.cfg.shape_parents and self.sampling.greedy:
            return self.build_static(self.cfg.budget if budget is None else budget)
        cfg = self.cfg
        budget = cfg.budget if budget is None else budget
        seed, self.ahead_seed = self.ahead_seed, None
        if seed is not None and not self.pending:  # the root and a chain below it were drafted during verification
            d = DraftTree(TokenTree(self.context[-1]), 1.0, 0)
            dist = seed.root_dist
        else:
            d = DraftTree(TokenTree(self.pending[-1]), 1.0, 1)
            dist = self._dist(self._feed_pending())
            d.catchup_s = self.catchup_s
            seed = None
        if self.trie and budget > 1:
            self._add_trie(d, budget - 1)
        if self.sampling.greedy and cfg.mode == "tree" and cfg.growth == "best":
            planted = self._plant(d, seed, dist, budget, expand=False) if seed is not None else []
            self._grow_best_first(d, [(ROOT, dist), *planted], budget)
            d.tc = d.tree.tree_confidence()
            return d
        self._expand(d, ROOT, dist, budget - len(d.tree))
        if seed is not None:
            self._plant(d, seed, dist, budget)
        while len(d.tree) < budget:
            if cfg.mode == "tree" and self.threshold.should_verify(d.tree.tree_confidence()):
                break
            # a tip under an unfed node (a trie chain) waits for it: its ancestors' KV entries must exist
            tips = [
                i
                for i in d.tree.tips()
                if d.tree.nodes[i].depth < min(cfg.max_depth, budget) and self._ready(d.tree, i)
            ]
            if not tips:
                break
            tip = pace(d.tree, tips)
            node = d.tree.nodes[tip]
            node.slot, dist = self._feed_node(
                node.token, node.depth, [d.tree.nodes[a].slot for a in d.tree.path(tip)[:-1]]
            )
            node.fed = True
            d.forwards += 1
            if self.sampling.greedy and cfg.ahead:  # drafting ahead may start from this node
                d.dists[tip] = dist
            self._expand(d, tip, dist, budget - len(d.tree))
        d.tc = d.tree.tree_confidence()
        return d

    @staticmethod
    def _ready(t: TokenTree, i: int) -> bool:
        """The draft can run on node i: its parent is the root or was run on (so every ancestor was)."""
        p = t.nodes[i].parent
        return p == ROOT or t.nodes[p].fed

    def advance(self, d: DraftTree | None, path: list[int], new_tokens: list[int]):
        """After a verification: keep the accepted nodes the draft already ran on; the rest is pending.

        With a chain drafted ahead from the accepted leaf whose first token is the target's own next token,
        that token becomes the root already fed, and the rest of the chain seeds the next tree."""
        self._remember(new_tokens)
        ahead, self.ahead, self.ahead_seed = self.ahead, None, None
        if d is None:
            self.cache.commit([])
            self.pending.extend(new_tokens)
            return
        t = d.tree
        fed = [i for i in path if t.nodes[i].fed]
        keep = [t.nodes[i].slot for i in fed]
        chain = []
        if ahead is not None and path and path[-1] == ahead.leaf and ahead.fed:
            # ahead.fed[0] is the leaf (fed now, if it was not); then the chain after it
            if not t.nodes[ahead.leaf].fed:
                keep.append(ahead.fed[0][1])
                fed.append(ahead.leaf)
            chain = ahead.fed[1:]
            bonus = new_tokens[len(path)]
            if chain and chain[0][0] == bonus:  # the target's next token is the chain's first: reuse it all
                keep += [slot for _, slot, _ in chain]
            else:
                chain = []
        # pending slots were filled in feed order; the accepted nodes' slots, in order
        L = self.cache.length
        self.cache.commit([slot - L for slot in keep])
        if chain:
            root_dist = chain[0][2]
            rest = chain[1:]
            self.cache.length -= len(rest)  # the chain after the root stays pending, for the next tree
            self.cache.pending = len(rest)
            self.pending = []
            self.ahead_seed = AheadSeed(root_dist, [tok for tok, _, _ in rest], [dist for _, _, dist in rest])
        else:
            self.pending = new_tokens[len(fed) :]

    def update_threshold(self, d: DraftTree, n_all: int, n_correct: int):
        if self.cfg.mode == "tree":
            self.threshold.update(d.tc, n_all, n_correct)


PROMPT_ROWS = 32  # a forward of more rows than this ran over a prompt (a tree's catch-up feeds a few)


class LocalDraft:
    """The draft side of the speculation cycle (speculative/loop.py) with the draft model in this process;
    the draft actor (actors/draft.py) runs it too, so what the draft does with a verdict is written once."""

    has_model = True

    def __init__(self, model: Transformer):
        self.model = model
        self.drafter: Drafter | None = None
        self.greedy = True

    def start(self, prompt_ids: list[int], capacity: int, first: int, cfg: TreeConfig, sampling: SamplingConfig):
        self.take_stats()  # what a generation stopped early left untaken is not this one's
        self.greedy = sampling.greedy
        self.drafter = Drafter(self.model, sampling, cfg)
        self.drafter.start(prompt_ids, capacity)
        self.drafter.push([first])

    def propose(self, budget: int) -> Proposal | None:
        return self._proposal(self.drafter.build_tree(budget))

    def lookup(self, max_nodes: int) -> Proposal | None:
        """The trie's candidates alone: the draft runs on none of them."""
        return self._proposal(self.drafter.lookup(max_nodes), drafted=False)

    def _proposal(self, d: DraftTree | None, drafted: bool = True) -> Proposal | None:
        """The tree as the target side takes it; under sampling with its trials and their distributions."""
        if d is None:
            return None
        trials = dists = None
        if not self.greedy:
            trials, qs = d.wire_trials()
            dists = torch.stack(qs).float() if qs else None
        return Proposal(d.tree.proposal(d.tc, d.forwards, d.trie_nodes, trials, d.catchup_s), drafted, d, dists)

    def ahead(self, p: Proposal | None, steps: int, stop=lambda: False) -> int:
        """Draft on from the tree until `stop()` (in the draft actor: until the verdict arrives)."""
        return self.drafter.draft_ahead(p.draft if p is not None else None, steps, stop)

    def advance(self, p: Proposal | None, path: list[int], new: list[int]) -> float:
        """Keep the accepted nodes the draft ran on; adapt the fallback threshold to the verdict."""
        d = p.draft if p is not None else None
        self.drafter.advance(d, path, new)
        if d is not None:
            self.drafter.update_threshold(d, *best_branch(d.tree, path))
        return self.drafter.threshold.alpha

    def release(self, p: Proposal) -> None:
        pass

    def fed_prompt(self) -> bool:
        """Whether the draft ran over a prompt since the last call (a forward of more than PROMPT_ROWS rows)."""
        wide, self.drafter.fed = self.drafter.fed > PROMPT_ROWS, 0
        return wide

    def ahead_counts(self) -> tuple[int, int]:
        return self.drafter.ahead_steps, self.drafter.ahead_reused

    def take_stats(self) -> dict:
        """A flash draft's reads since the last call (models/flash/weights.py `FlashStats`); {} for a draft model."""
        weights = self.model.weights
        if not hasattr(weights, "reset_stats"):
            return {}
        out = {"draft_flash": weights.stats.as_dict()}
        weights.reset_stats()
        return out
