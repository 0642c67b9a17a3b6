"""What a request carries: one dataclass per op payload, for the side that sends it and the actor that serves it.

On the wire a payload is a msgpack map of its fields. The scheduler sends a payload object
(`sched.call("draft", Build(budget=4))`: the op is the class's); an actor handler that annotates
its `args` with a payload class gets that object back (`def op_build(self, args: Build, tensors)`),
and a map with a field missing or one it does not know fails the request with one sentence.
Torch-free: the scheduler imports it.
"""
from __future__ import annotations

import functools
from dataclasses import MISSING, dataclass, fields
from typing import ClassVar


class Payload:
    op: ClassVar[str]

    def wire(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def read(cls, args: dict) -> "Payload":
        names, required = _fields(cls)
        if args.keys() <= names and required <= args.keys():  # every request takes this path: one set test each
            return cls(**args)
        unknown = sorted(set(args) - names)
        missing = sorted(required - set(args))
        if unknown or missing:
            what = "; ".join(filter(None, (unknown and f"unknown field(s) {', '.join(unknown)}",
                                           missing and f"missing field(s) {', '.join(missing)}")))
            raise ValueError(f"op {cls.op!r} takes {', '.join(f.name for f in fields(cls)) or 'no fields'}: {what}")
        return cls(**args)


@functools.cache
def _fields(cls) -> tuple[frozenset, frozenset]:
    """A payload class's field names, and those without a default."""
    fs = fields(cls)
    return (frozenset(f.name for f in fs),
            frozenset(f.name for f in fs if f.default is MISSING and f.default_factory is MISSING))


# -- the verifier (actors/verifier.py) ------------------------------------------------------------

@dataclass(frozen=True)
class Start(Payload):
    """Prefill the prompt (the cache keeps the prefix the last generation shares with it); the first token."""
    op = "start"
    prompt_ids: list
    capacity: int
    sampling: dict | None = None  # this generation's sampling; None: the run's


@dataclass(frozen=True)
class Step(Payload):
    """A plain decode step on the root."""
    op = "step"
    root: int


@dataclass(frozen=True)
class Tree(Payload):
    """A token tree: what the draft builds (its reply) and what the verifier verifies. Node i has
    token `tokens[i]` and parent `parents[i]` (-1: the root); under sampling `trials` are rows of
    [node, child, distribution index or -1] into the `dists` tensor that travels with it."""
    op = "verify"
    root: int
    tokens: list
    parents: list
    probs: list
    trials: list | None = None
    tc: float = 1.0  # the tree's confidence
    forwards: int = 0  # draft forwards that built it
    trie_nodes: int = 0  # nodes the trie proposed


@dataclass(frozen=True)
class Begin(Payload):
    """Job mode (streamed layers, the sparse worker): start `job` (start, step or verify) with `args`,
    the payload that job has in resident mode; the verifier answers with what it needs next. `split`
    {"id", "rows", "timeout_s"}: the sparse worker serves this job (actors/executor.py)."""
    op = "begin"
    job: str
    args: dict
    split: dict | None = None

    JOBS: ClassVar[dict] = {}  # job -> its payload class, filled below

    def job_payload(self) -> Payload:
        if self.job not in self.JOBS:
            raise ValueError(f"unknown job {self.job!r}; use start, step or verify")
        return self.JOBS[self.job].read(self.args)


@dataclass(frozen=True)
class Layer(Payload):
    """The streamed group the job waits for, in the arena slot `tensors["slot"]`."""
    op = "layer"
    group: str


@dataclass(frozen=True)
class Experts(Payload):
    """The experts of MoE layer `layer` the job waits for, each in the arena slot `tensors["e<id>"]`."""
    op = "experts"
    layer: int
    experts: list


Begin.JOBS.update(start=Start, step=Step, verify=Tree)


# -- the draft (actors/draft.py) ------------------------------------------------------------------

@dataclass(frozen=True)
class DraftStart(Payload):
    """A new prompt and the first generated token; `tree`: this generation's TreeConfig fields."""
    op = "start"
    prompt_ids: list
    capacity: int
    first: int
    tree: dict | None = None
    sampling: dict | None = None


@dataclass(frozen=True)
class Build(Payload):
    """A tree of at most `budget` tokens (its distributions into `tensors["slot"]` under sampling)."""
    op = "build"
    budget: int


@dataclass(frozen=True)
class Lookup(Payload):
    """The trie's candidates alone, at most `max_nodes`, no draft forward."""
    op = "lookup"
    max_nodes: int


@dataclass(frozen=True)
class Ahead(Payload):
    """Draft on from the last tree while the target verifies it, at most `steps` forwards."""
    op = "ahead"
    steps: int


@dataclass(frozen=True)
class Advance(Payload):
    """The verdict: the accepted nodes of the last tree and the committed tokens (`tree` false: a plain
    step, or candidates the draft did not run on)."""
    op = "advance"
    path: list
    new: list
    tree: bool = True


# -- the loader (actors/loader.py) ----------------------------------------------------------------

@dataclass(frozen=True)
class Groups(Payload):
    """The store's groups in file order, name -> bytes."""
    op = "groups"


@dataclass(frozen=True)
class Load(Payload):
    """Read `group` into the arena slot `tensors["slot"]`."""
    op = "load"
    group: str


# -- the sparse-attention worker (actors/sparse.py) -----------------------------------------------

@dataclass(frozen=True)
class Serve(Payload):
    """Serve the split of verifier job `job` (actors/executor.py) until the verifier ends it, waiting at
    most `timeout_s` for each of its steps; `rows`: the most rows a forward has. A prompt's first job
    brings the verifier's KV cache (`tensors["kv"]`, `capacity` rows) to map."""
    op = "serve"
    job: int
    rows: int
    timeout_s: float
    capacity: int | None = None
