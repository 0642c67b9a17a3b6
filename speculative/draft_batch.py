"""Several generations' draft trees grown in shared forwards (issue 42: "the draft grows every generation's tree in
shared forwards too").

Each generation grows its tree with its own `Drafter` (its own cache, growth policy and trie) as a generator of
its draft forwards (speculative/drafter.py `Drafter.build_tree_steps`): the trees advance in lockstep, and one
forward over every tree's rows answers a step of them all (models/batch.py: the linear layers over all rows, each
one's attention over its own cache). A draft forward of a few rows reads the whole draft model from memory; four
trees' rows together cost about half of four forwards (BENCHMARKS.md). Each row gets the bits it gets alone, so
every tree is the one its generation would grow alone (tests/speculative/test_lockstep.py).

All in the caller's thread: a forward run from other threads (one per tree, as a first version did) cost twice
as much, each thread's OpenMP team of its own starting and spinning beside the others.
"""

from __future__ import annotations

from models.batch import forward_many_steps
from models.transformer import Transformer
from models.requests import drive
from speculative.feed import run_here


def shares_forwards(model: Transformer) -> bool:
    """Whether the draft's forwards can be shared (dense blocks on the CPU kernels); else the trees grow one by
    one."""
    return model.fused and not model.args.moe and not hasattr(model.weights, "reset_stats")


def grow_together(model: Transformer, growers: list) -> list:
    """What each of `growers` (generators of draft forwards over `model`: they yield `Rows`, are sent their
    logits) returns, their forwards shared: each step, one forward over the rows of every grower still growing.
    An error in one grower is raised once every grower is closed."""
    if len(growers) == 1 or not shares_forwards(model):
        return [run_here(g, model) for g in growers]
    results: list = [None] * len(growers)
    asked = {}  # grower -> the rows of its next forward
    try:
        for i, g in enumerate(growers):
            _step(g, i, lambda: next(g), asked, results)
        while asked:
            who = list(asked)
            outs = drive(forward_many_steps(model, [asked.pop(i) for i in who]), model.weights)
            for i, out in zip(who, outs):
                _step(growers[i], i, lambda: growers[i].send(out), asked, results)
    finally:
        for g in growers:
            g.close()
    return results


def _step(grower, i: int, move, asked: dict, results: list) -> None:
    """Move grower `i` on (`move()`): its next forward's rows go to `asked`, or its result to `results`."""
    try:
        asked[i] = move()
    except StopIteration as done:
        results[i] = done.value
