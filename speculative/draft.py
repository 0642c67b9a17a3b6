"""The draft side: a small model kept in step with the committed text, growing token trees.

`Drafter` owns the draft model's KV cache. The committed text is in that cache except for a
tail of `pending` tokens (at least the root, the newest token). `build_tree` feeds the pending
tail, then grows a tree one draft forward per step: the branch pacer picks the tip, the tree
attention mask lets the tip see only its own ancestors (LLMCad's tree decoder), and the tree
stops growing when Tc falls below alpha or it reaches the verification width.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cadence.errors import CadenceError
from models.attention import Visibility
from models.sampling import Sampler, SamplingConfig, probs
from models.transformer import Transformer
from speculative.policy import AdaptiveThreshold, branch_candidates, pace
from speculative.tree import ROOT, TokenTree

TOP_K = 4  # candidates looked at per expansion


@dataclass(frozen=True)
class TreeConfig:
    mode: str = "tree"  # "tree" or "chain"
    width: int = 8  # most draft tokens in one verification
    max_depth: int = 8
    branch_threshold: float = 0.3
    alpha: float = 0.01
    chain_k: int = 4  # chain mode: draft tokens per verification

    def __post_init__(self):
        if self.mode not in ("tree", "chain"):
            raise CadenceError(f"tree mode '{self.mode}' must be tree or chain")
        if not 1 <= self.width <= 64:
            raise CadenceError(f"verification width {self.width} must be within 1..64")
        if self.max_depth < 1 or self.chain_k < 1:
            raise CadenceError("max_depth and chain_k must be at least 1")
        if not 0 < self.branch_threshold <= 1:
            raise CadenceError(f"branch_threshold={self.branch_threshold} must be in (0, 1]")
        if not 0 <= self.alpha < 1:
            raise CadenceError(f"alpha={self.alpha} must be in [0, 1)")

    @property
    def budget(self) -> int:
        return self.chain_k if self.mode == "chain" else self.width


@dataclass
class DraftTree:
    tree: TokenTree
    tc: float
    forwards: int
    trials: dict[int, list[int]] = field(default_factory=dict)  # sampling: draws per node
    dists: dict[int, torch.Tensor] = field(default_factory=dict)  # sampling: draft distribution per node


class Drafter:
    def __init__(self, model: Transformer, sampling: SamplingConfig, cfg: TreeConfig):
        self.model, self.sampling, self.cfg = model, sampling, cfg
        self.sampler = Sampler(SamplingConfig(sampling.temperature, sampling.top_p, sampling.seed + 1))
        self.threshold = AdaptiveThreshold(cfg.alpha)
        self.cache = None
        self.pending: list[int] = []

    def start(self, prompt_ids: list[int], capacity: int):
        """Feed the prompt; the first generated token will arrive through `advance`."""
        self.cache = self.model.new_cache(capacity)
        self.pending = list(prompt_ids)

    def _feed_pending(self) -> torch.Tensor:
        c, dev = self.cache, self.model.device
        ids = torch.tensor(self.pending, device=dev)
        logits = self.model.forward(ids, torch.arange(c.length, c.length + len(ids), device=dev), c,
                                    logits_rows=slice(-1, None))[0]
        c.commit()
        self.pending = []
        return logits

    def _dist(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution a draft token is chosen from (greedy: the plain softmax, as confidence)."""
        if self.sampling.greedy:
            return torch.softmax(logits.float(), -1)
        return probs(logits, self.sampling)

    def _expand(self, d: DraftTree, node: int, dist: torch.Tensor, room: int):
        t = d.tree
        if self.sampling.greedy:
            top = torch.topk(dist, TOP_K)
            cands = list(zip(top.indices.tolist(), top.values.tolist()))
            if self.cfg.mode == "chain":
                cands = cands[:1]
            for tok, p in branch_candidates(cands, self.cfg.branch_threshold, room):
                t.add(tok, node, p)
            return
        # Sampling: k i.i.d. draws from q, k fixed by q alone (how many candidates clear the threshold).
        k = 1 if self.cfg.mode == "chain" else max(1, int((dist >= self.cfg.branch_threshold).sum()))
        k = min(k, room)
        d.dists[node] = dist
        d.trials[node] = []
        for _ in range(k):
            tok = self.sampler.draw(dist)
            child = next((c for c in t.children(node) if t.nodes[c].token == tok), None)
            if child is None:
                child = t.add(tok, node, float(dist[tok]))
            d.trials[node].append(child)

    def build_tree(self, budget: int | None = None) -> DraftTree:
        """Grow a tree of at most `budget` tokens (default: the verification width) under the root."""
        cfg = self.cfg
        budget = cfg.budget if budget is None else budget
        root = self.pending[-1]
        d = DraftTree(TokenTree(root), 1.0, 1)
        self._expand(d, ROOT, self._dist(self._feed_pending()), budget)
        c, dev = self.cache, self.model.device
        while len(d.tree) < budget:
            if cfg.mode == "tree" and self.threshold.should_verify(d.tree.tree_confidence()):
                break
            tips = [i for i in d.tree.tips() if d.tree.nodes[i].depth < min(cfg.max_depth, budget)]
            if not tips:
                break
            tip = pace(d.tree, tips)
            node = d.tree.nodes[tip]
            anc = [d.tree.nodes[a].slot for a in d.tree.path(tip)[:-1]]
            slot = c.end
            vis = Visibility(c.length, torch.tensor([0, len(anc) + 1], dtype=torch.int32),
                             torch.tensor(anc + [slot], dtype=torch.int32))
            logits = self.model.forward(torch.tensor([node.token], device=dev),
                                        torch.tensor([c.length + node.depth - 1], device=dev), c, vis)[0]
            node.fed, node.slot = True, slot
            d.forwards += 1
            self._expand(d, tip, self._dist(logits), budget - len(d.tree))
        d.tc = d.tree.tree_confidence()
        return d

    def advance(self, d: DraftTree | None, path: list[int], new_tokens: list[int]):
        """After a verification: keep the accepted nodes the draft already ran on; the rest is pending."""
        if d is None:
            self.cache.commit([])
            self.pending.extend(new_tokens)
            return
        t = d.tree
        fed = [i for i in path if t.nodes[i].fed]
        # pending slots were filled in feed order; the accepted nodes' slots, in order
        self.cache.commit([t.nodes[i].slot - self.cache.length for i in fed])
        self.pending = new_tokens[len(fed):]

    def update_threshold(self, d: DraftTree, n_all: int, n_correct: int):
        if self.cfg.mode == "tree":
            self.threshold.update(d.tc, n_all, n_correct)
