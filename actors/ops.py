"""What travels: one dataclass per op payload and one per reply, for both sides of the wire.

On the wire a payload is a msgpack map of its fields. The scheduler sends a payload object
(`sched.call("draft", Build(budget=4))`: the op is the class's); an actor handler that annotates
its `args` with a payload class gets that object back (`def op_build(self, args: Build, tensors)`),
and a map with a field missing or one it does not know fails the request with one sentence.
A handler may answer with a reply dataclass (REPLIES: `Token`, `Tree`, `AwaitGroup`, ...); it
travels as its fields plus `"reply": <kind>`, and `Reply.value` (actors/wire.py) gives the
dataclass back. Torch-free: the scheduler imports it.
"""

from __future__ import annotations

import functools
from dataclasses import MISSING, dataclass, fields
from typing import ClassVar

from speculative.tree import Tree, Verdict


class Payload:
    op: ClassVar[str]

    def wire(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def read(cls, args: dict) -> "Payload":
        return _read(cls, args, f"op {cls.op!r}")


def _read(cls, args: dict, what: str):
    """`cls(**args)`, or one sentence that names the fields missing or unknown."""
    names, required = _fields(cls)
    if args.keys() <= names and required <= args.keys():  # every message takes this path: one set test each
        return cls(**args)
    unknown = sorted(set(args) - names)
    missing = sorted(required - set(args))
    why = "; ".join(
        filter(
            None,
            (
                unknown and f"unknown field(s) {', '.join(unknown)}",
                missing and f"missing field(s) {', '.join(missing)}",
            ),
        )
    )
    raise ValueError(f"{what} takes {', '.join(f.name for f in fields(cls)) or 'no fields'}: {why}")


@functools.cache
def _fields(cls) -> tuple[frozenset, frozenset]:
    """A payload class's field names, and those without a default."""
    fs = fields(cls)
    return (
        frozenset(f.name for f in fs),
        frozenset(f.name for f in fs if f.default is MISSING and f.default_factory is MISSING),
    )


# -- the verifier (actors/verifier.py) ------------------------------------------------------------


@dataclass(frozen=True)
class Start(Payload):
    """Prefill the prompt (the cache keeps the prefix the last generation shares with it); the first token."""

    op = "start"
    prompt_ids: list
    capacity: int
    sampling: dict | None = None  # this generation's sampling; None: the run's
    reuse: bool = True  # False: prefill the whole prompt (a benchmark's modes each pay their own prefill)


@dataclass(frozen=True)
class PlainStep(Payload):
    """A plain decode step on the root."""

    op = "step"
    root: int


@dataclass(frozen=True)
class Verify(Tree, Payload):
    """Verify a token tree (speculative/tree.py `Tree`: what the draft's `build` and `lookup` answer);
    under sampling its trials index the `dists` tensor that travels with it."""

    op = "verify"

    @classmethod
    def of(cls, tree: Tree) -> "Verify":
        return cls(**{f.name: getattr(tree, f.name) for f in fields(Tree)})


@dataclass(frozen=True)
class Begin(Payload):
    """Job mode (streamed layers, the sparse worker): start `job` (start, step or verify) with `args`,
    the payload that job has in resident mode; the verifier answers with what it needs next
    (`AwaitGroup`, `AwaitExperts`) or, at the job's end, its result (`Token`, `Verdict`). `split`
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


Begin.JOBS.update(start=Start, step=PlainStep, verify=Verify)


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
class DraftStats(Payload):
    """What the draft measured since the last ask (a flash draft's reads), for the generation's row."""

    op = "take_stats"


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


# -- replies ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Token:
    """A prefill's or a plain step's token; `reused`: prompt tokens the prefill found in the cache."""

    token: int
    reused: int = 0


@dataclass(frozen=True)
class AwaitGroup:
    """A job waits for a streamed store group ("layer.7", "head.0"): answer with `Layer`."""

    group: str


@dataclass(frozen=True)
class AwaitExperts:
    """A job waits for the experts of MoE layer `layer` its tokens route to (`guess`: the next layer's likely
    ones, for the buffer to preload): answer with `Experts`."""

    layer: int
    experts: list
    guess: list


@dataclass(frozen=True)
class Advanced:
    """The draft took a verdict: alpha after it, and drafting ahead's counts so far this generation."""

    alpha: float
    ahead_steps: int
    ahead_reused: int


@dataclass(frozen=True)
class GroupSizes:
    """The loader's store: group name -> bytes, in file order."""

    groups: dict
    file_bytes: int


@dataclass(frozen=True)
class Loaded:
    """A group read into its slot: bytes, seconds, GB/s, and whether the read bypassed the page cache."""

    group: str
    bytes: int
    seconds: float
    gbps: float
    direct: bool


REPLIES: dict[str, type] = {
    "token": Token,
    "verdict": Verdict,
    "await_group": AwaitGroup,
    "await_experts": AwaitExperts,
    "tree": Tree,
    "advanced": Advanced,
    "group_sizes": GroupSizes,
    "loaded": Loaded,
}
_KINDS = {cls: kind for kind, cls in REPLIES.items()}


def is_reply(value) -> bool:
    return type(value) in _KINDS


def reply_wire(value) -> dict:
    """A reply dataclass as it travels: its fields and its kind."""
    return {"reply": _KINDS[type(value)], **{f.name: getattr(value, f.name) for f in fields(value)}}


def read_reply(result: dict):
    """A reply map back into its dataclass (a map without a kind stays as it is)."""
    kind = result.get("reply")
    if kind is None:
        return result
    if kind not in REPLIES:
        raise ValueError(f"a reply of unknown kind {kind!r}; the kinds are {', '.join(REPLIES)}")
    return _read(REPLIES[kind], {k: v for k, v in result.items() if k != "reply"}, f"a {kind!r} reply")
