"""FAKE target and draft actors (see actors.py beside this module): the target is a pure function of the text, the
draft guesses it right with probability `accept_p`, so every speculative mode must give `target_text`.
None of them imports torch.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque

from common.settings import PREFILL_CHUNK
from tests.runtime.fakes.actors import LOG_ENTRIES, FakeActor, FakeSync, check_slot, slot_bytes, target_next
from actors.syncarea import VERIFIER as VERIFIER_WORD, WORKER as WORKER_WORD
from actors.calls import AwaitGroup, DraftCycle, Drafted, Token, record, signature
from speculative.tree import Tree, Verdict

NO_TREE = Tree(-1, [], [], [])  # no candidates


class FakeVerifierActor(FakeActor):
    """The target. Resident (`start`, `step`, `verify`) or job mode (`begin`, then `layer` for each
    streamed group) as the real one; with the worker, a multi-row job meets it in the sync area."""

    role = "verifier"
    DURATIONS = {"group": (0.0002, 0.0005), "dense": (0.0001, 0.0002), "cols": (0.0001, 0.0002)}

    def __init__(self, init: dict, ctx):
        super().__init__(init, ctx)
        self.order = list(self.model.get("groups", {}))
        resident = init.get("resident")
        self.streamed = set() if resident is None else set(self.order) - set(resident)
        self.worker = init.get("worker")
        self.share = float((self.worker or {}).get("share", 0.0))
        self.columns = float((self.worker or {}).get("columns", 0.0))
        self.text: list[int] = []  # what the KV cache holds
        self.job = self.need = None
        self.sync: FakeSync | None = None  # the job the worker serves with us
        self.splits = 0  # jobs split with the worker
        self.last_load = -1  # load numbers of the slots consumed only grow
        self.consumed: deque = deque(maxlen=LOG_ENTRIES)  # (group, load number)
        self.begun: deque = deque(maxlen=LOG_ENTRIES)  # (job, time.monotonic()) of each `begin`

    # -- the target ------------------------------------------------------------------------------

    def _forward(self, rows: int):
        """One pass over the target's groups in order: yields what it needs from outside, as the
        real verifier's job does, and is sent the tensors of the op that brings it."""
        split = self.sync is not None and rows > 1
        for g in self.order:
            if g in self.streamed:
                tensors = yield AwaitGroup(g)
                buf = slot_bytes(self, tensors["slot"], self.model["groups"][g])
                seq = check_slot(buf, g)
                if seq <= self.last_load:
                    raise ValueError(
                        f"the slot for {g} holds load {seq}, older than load {self.last_load} used before it"
                    )
                self.work("group", 1.0 - self.share, span=f"compute:{g}")
                check_slot(buf, g)  # nobody wrote into it while we used it
                self.last_load = seq
                self.consumed.append((g, seq))
            else:
                self.work("group", 1.0 - self.share, span=f"compute:{g}")
            if split and g.startswith("layer."):  # attention (and, with a column share, the linears) shared
                for part in ("attn", "cols") if self.columns > 0 else ("attn",):
                    self.sync.step += 1
                    self.sync.post(VERIFIER_WORD, self.sync.step)
                    self.work(
                        "dense" if part == "attn" else "cols",
                        1.0 - (self.share if part == "attn" else self.columns),
                        span=f"{part}:{g}",
                    )
                    self.sync.wait(WORKER_WORD, self.sync.step, f"{g}'s {part}")

    def _start(self, prompt: list[int], reuse: bool = True):
        reused = 0
        while reuse and reused < min(len(prompt) - 1, len(self.text)) and prompt[reused] == self.text[reused]:
            reused += 1
        for i in range(reused, len(prompt), PREFILL_CHUNK):
            yield from self._forward(min(PREFILL_CHUNK, len(prompt) - i))
        self.text = list(prompt)
        return Token(target_next(self.text, self.vocab), reused)

    def _step(self, root: int):
        yield from self._forward(1)
        self.text.append(root)
        return Token(target_next(self.text, self.vocab))

    def _verify(self, tree: Tree):
        """Greedy: from the root, the child holding the target's token, while there is one."""
        tokens, parents = list(tree.tokens), list(tree.parents)
        yield from self._forward(len(tokens) + 1)
        self.text.append(tree.root)
        path, at = [], -1
        while True:
            want = target_next(self.text, self.vocab)
            nxt = next((j for j, (t, p) in enumerate(zip(tokens, parents)) if p == at and t == want), None)
            if nxt is None:
                return Verdict(path, want, len(tokens) + 1)
            path.append(nxt)
            self.text.append(want)
            at = nxt

    def _job(self, job: str, args: dict):
        if job == "start":
            return self._start(list(args["prompt_ids"]), args.get("reuse", True))
        if job == "step":
            return self._step(args["root"])
        return self._verify(args["tree"])

    # -- resident --------------------------------------------------------------------------------

    def _whole(self, job: str, args: dict):
        steps = self._job(job, args)
        try:
            need = next(steps)
        except StopIteration as done:
            return done.value
        raise RuntimeError(f"a resident {job} needs {need}: this verifier was started with streamed groups or a worker")

    def op_start(self, prompt_ids: list, capacity: int, sampling: dict | None = None, reuse: bool = True):
        return self._whole("start", {"prompt_ids": prompt_ids, "reuse": reuse})

    def op_step(self, root: int):
        return self._whole("step", {"root": root})

    def op_verify(self, tree: Tree, tensors: dict):
        return self._whole("verify", {"tree": tree})

    # -- job mode ----------------------------------------------------------------------------------

    def op_begin(self, job: str, args: dict, tensors: dict, split: dict | None = None):
        if self.job is not None:
            raise RuntimeError(f"a job is still waiting for {self.need}")
        if job not in ("start", "step", "verify"):
            raise ValueError(f"unknown job {job!r}; use start, step or verify")
        bound = signature(getattr(type(self), "op_" + job), job).bind(args, tensors)  # as the real verifier checks
        self.begun.append((job, time.monotonic()))
        self.sync = None
        if split is not None:  # the worker serves this job: meet it in the sync area, step by step
            sp = split
            self.sync = FakeSync(
                self, tensors["sync"], int(sp["id"]), int(sp["rows"]), "the sparse worker", float(sp["timeout_s"])
            )
            self.sync.begin()
            self.splits += 1
        self.job = self._job(job, bound)
        return self._resume(None)

    def op_layer(self, group: str, tensors: dict):
        if self.job is None or not isinstance(self.need, AwaitGroup) or group != self.need.group:
            raise RuntimeError(f"layer {group} arrived but the verifier waits for {self.need}")
        return self._resume(tensors)

    def _resume(self, value):
        try:
            self.need = self.job.send(value)
        except StopIteration as done:
            self.job = self.need = None
            if self.sync is not None:
                self.sync.end()
            return done.value
        except BaseException:
            self.job = self.need = None
            if self.sync is not None:
                self.sync.abandon()
            raise
        return self.need

    def op_stats(self):
        return {
            **super().op_stats(),
            "worker": self.worker,
            "streamed": sorted(self.streamed),
            "consumed": list(self.consumed),
            "begun": list(self.begun),
            "splits": self.splits,
        }


class FakeDraftActor(FakeActor):
    """The draft: a tree (or chain) whose tokens are the target's with probability `accept_p`."""

    role = "draft"
    DURATIONS = {"build": (0.0005, 0.001), "ahead": (0.0005, 0.001)}

    def __init__(self, init: dict, ctx):
        super().__init__(init, ctx)
        self.accept_p = float(self.script.get("accept_p", 0.7))
        self.tree = dict(init.get("tree", {}))
        self.text: list[int] = []
        self.depth = 0  # of the last tree built

    def op_start(self, prompt_ids: list, capacity: int, first: int, tree: dict | None = None, sampling=None):
        self.tree = dict(tree or self.tree)
        self.text = list(prompt_ids) + [first]
        return {}

    def _grow(self, budget: int, chain: bool, max_depth: int) -> dict:
        """A chain of guesses; in tree mode each guess has a sibling leaf holding the other candidate."""
        v, text = self.vocab, list(self.text)
        tokens, parents, probs, parent, tc = [], [], [], -1, 1.0
        while len(tokens) < budget and len(text) - len(self.text) < max_depth:
            right = target_next(text, v)
            wrong = (right + 1 + self.rng.randrange(v - 1)) % v
            hit = self.rng.random() < self.accept_p
            tokens.append(right if hit else wrong)
            parents.append(parent)
            probs.append(0.9 if hit else 0.6)
            me = len(tokens) - 1
            tc *= probs[me]
            if not chain and len(tokens) < budget:
                tokens.append(wrong if hit else right)
                parents.append(parent)
                probs.append(0.1 if hit else 0.4)
            parent = me
            text.append(tokens[me])
        self.depth = len(text) - len(self.text)
        return {
            "root": self.text[-1],
            "tokens": tokens,
            "parents": parents,
            "probs": probs,
            "tc": tc,
        }  # a Tree's fields

    def op_cycle(self, cycles: list):
        """One generation's cycle (actors/calls.py `DraftCycle`): the verdict on the last tree and the tokens behind
        taken, then a tree (the trie's candidates: sometimes none, else a short chain), then drafting ahead after
        the reply until the next message."""
        (c,) = [record(DraftCycle, c, "a draft cycle") for c in cycles]
        if c.path is not None:
            self.text += list(c.new)
        self.text += list(c.behind)
        tree = None
        if c.lookup:
            tree = NO_TREE if self.rng.random() < 0.5 else self._lookup(c.budget)
        elif c.budget:
            self.work("build")
            chain = self.tree.get("mode") == "chain"
            t = self._grow(c.budget, chain, int(self.tree.get("max_depth", 8)))
            tree = Tree(**t, forwards=self.depth, trie_nodes=0)
            if c.ahead and tree.tokens:
                self.after_reply = lambda: self._ahead(c.ahead)
        return Drafted([None if tree is None else dataclasses.asdict(tree)], [[0, 0]])

    def _lookup(self, max_nodes: int) -> Tree:
        tree = self._grow(min(2, max_nodes), True, 2)
        return Tree(**tree, forwards=0, trie_nodes=len(tree["tokens"]))

    def _ahead(self, steps: int) -> None:
        self.calls["ahead"] = self.calls.get("ahead", 0) + 1  # drafting ahead ran (after a cycle's reply)
        done = 0
        while done < steps and not self.interrupted():
            self.work("ahead")
            done += 1

    def op_take_stats(self):
        return {}  # a fake draft reads nothing
