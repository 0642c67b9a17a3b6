"""Speculation with no draft model: the Lookahead trie's candidates alone (`--draft none`).

Where the budget cannot hold a draft model, the n-grams of the prompt and of the output still
propose continuations (Lookahead, section 4.3): code being copied or edited repeats itself, and a
verification under a memory budget costs about one read of the streamed layers whatever its width.
This side keeps the committed text and its trie and answers each cycle with a tree of candidates
(or none); the target verifies them like any draft's. It imports no torch: it runs in the
scheduler, so `--draft none` starts no draft actor at all.
"""

from __future__ import annotations

from speculative.sides import Proposal
from speculative.tree import TokenTree, Tree
from speculative.trie import TokenTrie, grammar_keep


class PromptLookup:
    def __init__(self, max_nodes: int = 8, capacity: int = 200_000):
        self.max_nodes = max_nodes
        self.trie = TokenTrie(capacity=capacity)
        self.context: list[int] = []
        self.constraint = None  # a grammar's (speculative/grammar.py): the candidates it forbids are not proposed
        self.forced = 0  # tokens proposed because the grammar allowed them alone (each certain)

    def start(self, prompt_ids: list[int], first: list[int], constraint=None):
        """A new prompt and the first generated token(s): the trie keeps what it learned before."""
        self.context, self.constraint = list(prompt_ids), constraint
        self.trie.insert(self.context)
        self.push(first)

    def push(self, tokens: list[int]):
        """Committed tokens: the text the next candidates continue."""
        self.context.extend(tokens)
        self.trie.insert(self.context, start=len(self.context) - len(tokens) - self.trie.branch_len + 1)

    def tree(self, max_nodes: int | None = None) -> Tree | None:
        """The candidates continuing the text, or None when the trie has none. Under a grammar, the run of tokens
        it allows alone comes first (certain, no model asked), the trie's candidates below it."""
        most = max_nodes or self.max_nodes
        forced = self.constraint.forced(self.context)[:most] if self.constraint is not None else []
        context = self.context + forced
        got = self.trie.retrieve(context, most - len(forced), keep=grammar_keep(self.constraint, context))
        if not got.tokens and not forced:
            return None
        t = TokenTree(self.context[-1])
        at = t.chain(forced)
        index = {}
        for i, (tok, parent, p) in enumerate(zip(got.tokens, got.parents, got.probs)):
            index[i] = t.add(tok, index[parent] if parent >= 0 else at, p)
        self.forced += len(forced)
        return t.proposal(trie_nodes=len(got.tokens) + len(forced))


class TrieDraft:
    """The draft side of the speculation cycle (speculative/loop.py) with no draft model: the trie
    proposes, the target verifies; runs wherever the loop runs (the scheduler, or one process)."""

    has_model = False

    def __init__(self, width: int = 8, vocabulary: tuple[str, int] | None = None):
        """`vocabulary`: the target's (weight store directory, output rows), which a grammar is matched in."""
        self.trie = PromptLookup(width)
        self.vocabulary = vocabulary

    def start(self, prompt_ids: list[int], capacity: int, first: int, cfg, sampling) -> None:
        constraint = None
        if sampling.grammar:
            from speculative.grammar import Constraint

            store, rows = self.vocabulary or (None, 0)
            constraint = Constraint.of(sampling, store, rows, len(prompt_ids))
        self.trie.start(prompt_ids, [first], constraint)

    def propose(self, budget: int, ahead: int = 0) -> Proposal | None:
        return None  # no draft model: the governor plays lookup or a plain step

    def lookup(self, max_nodes: int) -> Proposal | None:
        tree = self.trie.tree(max_nodes)
        return Proposal(tree, drafted=False) if tree is not None else None

    def advance(self, p, path: list[int], new: list[int]) -> None:
        self.trie.push(new)

    def ahead_counts(self) -> tuple[int, int]:
        return 0, 0

    def take_stats(self) -> dict:
        """The tokens a grammar forced since the last call (none: {})."""
        forced, self.trie.forced = self.trie.forced, 0
        return {"forced": forced} if forced else {}
