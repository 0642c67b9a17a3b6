"""Several generations' draft trees grown in shared forwards (issue 42: "the draft grows every generation's tree in
shared forwards too").

Each generation grows its tree with its own `Drafter` (its own cache, growth policy and trie), on a thread of its
own; each draft forward it asks for waits at a meeting point until every tree still growing has asked for one (or
finished), and one forward over all their rows answers them (models/batch.py: the linear layers over all rows, each
one's attention over its own cache). A draft forward of one row reads the whole draft model from memory; four
trees' rows together cost little more than one. Each row gets the bits it gets alone, so every tree is the one
its generation would grow alone (tests/speculative/test_lockstep.py).
"""

from __future__ import annotations

import threading

import torch

from common.heap import one_arena
from models.batch import Rows, forward_many_steps
from models.transformer import Transformer
from models.weights import drive


class SharedForwards:
    """The meeting point: `forward` from each grower's thread; one forward over all of theirs."""

    def __init__(self, model: Transformer, growers: int):
        self.model = model
        self.cv = threading.Condition()
        self.growing = growers  # threads still growing a tree
        self.asked: dict[int, Rows] = {}  # grower -> its rows, until the forward that answers them
        self.answers: dict[int, object] = {}  # grower -> its logits (or the error that ended the forward)

    def forward(self, who: int, rows: Rows) -> torch.Tensor:
        with self.cv:
            self.asked[who] = rows
            self._run_if_all_asked()
            while who not in self.answers:
                self.cv.wait()
            got = self.answers.pop(who)
        if isinstance(got, BaseException):
            raise got
        return got

    def done(self) -> None:
        """A grower's tree is grown (or failed): the others no longer wait for it."""
        with self.cv:
            self.growing -= 1
            self._run_if_all_asked()

    def _run_if_all_asked(self) -> None:
        if not self.asked or len(self.asked) < self.growing:
            return
        who, rows = list(self.asked), list(self.asked.values())
        self.asked.clear()
        try:
            outs = drive(forward_many_steps(self.model, rows), self.model.weights)
        except BaseException as e:  # noqa: BLE001 - every grower of this forward gets the error
            outs = [e] * len(who)
        self.answers.update(zip(who, outs))
        self.cv.notify_all()


class _Through:
    """The draft model as one grower's `DraftFeed` sees it while the trees grow together: `forward` goes to the
    meeting point, everything else to the model."""

    def __init__(self, model: Transformer, shared: SharedForwards, who: int):
        self._model, self._shared, self._who = model, shared, who

    def forward(self, tokens, positions, cache, vis=None, logits_rows=None, argmax=False):
        last = isinstance(logits_rows, slice) and logits_rows == slice(-1, None)
        if argmax or (logits_rows is not None and not last):
            raise ValueError("a shared draft forward gives every row's logits, or the last row's")
        return self._shared.forward(self._who, Rows(tokens, positions, cache, vis, last=last))

    def __getattr__(self, name):
        return getattr(self._model, name)


def shares_forwards(model: Transformer) -> bool:
    """Whether the draft's forwards can be shared (dense blocks on the CPU kernels); else the trees grow one by
    one."""
    return model.fused and not model.args.moe and not hasattr(model.weights, "reset_stats")


def grow_together(model: Transformer, feeds: list, grow) -> list:
    """`grow(i)` for each of `feeds` (the growers' `DraftFeed`s, over `model`), on threads whose draft forwards are
    shared; their results in order. An error in one grower is raised once all have stopped."""
    if len(feeds) == 1 or not shares_forwards(model):
        return [grow(i) for i in range(len(feeds))]
    one_arena()
    shared = SharedForwards(model, len(feeds))
    results: list = [None] * len(feeds)
    errors: list = []

    def run(i: int) -> None:
        feeds[i].model = _Through(model, shared, i)
        try:
            results[i] = grow(i)
        except BaseException as e:  # noqa: BLE001 - raised in the caller's thread below
            errors.append(e)
        finally:
            feeds[i].model = model
            shared.done()

    threads = [threading.Thread(target=run, args=(i,), name=f"draft-grower-{i}") for i in range(len(feeds))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results
