"""The one typed path across the process boundary, for both sides of the wire (torch-free: the scheduler
imports it).

A request is an op's name, its arguments as a msgpack map and its tensors as arena descriptors
(actors/wire.py `Request`). An actor serves op `cycle` with its method `op_cycle`, whose signature is the
op's type: each argument a keyword parameter, checked against its annotation as it arrives (int, float,
bool, str, list, dict, None, or a dataclass sent as the map of its fields, e.g. speculative/tree.py `Tree`);
a parameter named `tensors` takes the request's tensor map. A map with an argument missing, one the op does
not take or a value of the wrong type fails the request with one sentence that names it (`bind`).

    # the scheduler side (scheduler/remote.py)        # the actor side (actors/draft.py)
    draft = Remote(sched, "draft")                      def op_cycle(self, cycles: list): ...
    drafted = draft.cycle(cycles=[{"budget": 4}])

A handler may answer with a reply dataclass (REPLIES: `Token`, `Tree`, `AwaitGroup`, ...); it travels as its
fields plus `"reply": <kind>`, and `Reply.value` (actors/wire.py) gives the dataclass back.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
import typing
from dataclasses import MISSING, dataclass, fields

from speculative.tree import Tree, Verdict


def _read(cls, args: dict, what: str):
    """`cls(**args)`, or one sentence that names the fields missing or unknown."""
    names, required = _fields(cls)
    if args.keys() <= names and required <= args.keys():  # every message takes this path: one set test each
        return cls(**args)
    raise ValueError(
        f"{what} takes {', '.join(f.name for f in fields(cls)) or 'no fields'}: {_why(args, names, required)}"
    )


def _why(args: dict, names, required) -> str:
    unknown = sorted(set(args) - names)
    missing = sorted(required - set(args))
    return "; ".join(
        filter(
            None,
            (
                unknown and f"unknown argument(s) {', '.join(unknown)}",
                missing and f"missing argument(s) {', '.join(missing)}",
            ),
        )
    )


@functools.cache
def _fields(cls) -> tuple[frozenset, frozenset]:
    """A dataclass's field names, and those without a default."""
    fs = fields(cls)
    return (
        frozenset(f.name for f in fs),
        frozenset(f.name for f in fs if f.default is MISSING and f.default_factory is MISSING),
    )


# -- the op's signature: what a request's arguments must be ---------------------------------------------


@dataclass(frozen=True)
class Signature:
    op: str
    params: tuple  # (name, accepted types or a dataclass, has a default), the tensors aside
    names: frozenset
    required: frozenset
    takes_tensors: bool
    takes_any: bool  # **kwargs: any argument (op `ping` echoes what it is given)

    def bind(self, args: dict, tensors: dict) -> dict:
        """The handler's keyword arguments for a request, or ValueError in one sentence."""
        if not self.takes_any and not (args.keys() <= self.names and self.required <= args.keys()):
            shown = ", ".join(n for n, _, _ in self.params) or "no arguments"
            raise ValueError(f"op {self.op!r} takes {shown}: {_why(args, self.names, self.required)}")
        kwargs = dict(args)
        for name, kind, _ in self.params:
            if name in kwargs:
                kwargs[name] = _check(f"op {self.op!r}", name, kind, kwargs[name])
        if self.takes_tensors:
            kwargs["tensors"] = tensors
        return kwargs


def _accepted(hint) -> tuple:
    """A parameter's annotation as the types a value may have (a dataclass among them: sent as the map of its
    fields)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return tuple(t for h in typing.get_args(hint) for t in _accepted(h))
    if hint is type(None) or hint is None:
        return (type(None),)
    if hint is typing.Any or hint is inspect.Parameter.empty:
        return (object,)
    return (typing.get_origin(hint) or hint,)


def _check(what: str, name: str, kind: tuple, value):
    """`value` as argument `name` of `what` (an op, an actor's start) takes it: one of the types in `kind`, a dataclass
    from the map of its fields; else one sentence that names it."""
    if object in kind or type(value) in kind:
        return value
    if type(value) is int and float in kind:
        return float(value)
    record = next((t for t in kind if dataclasses.is_dataclass(t)), None)
    if record is not None and isinstance(value, dict):
        return _read(record, value, f"{what}: argument {name!r} ({record.__name__})")
    if record is not None and isinstance(value, record):
        return value
    want = " or ".join(f"a map of {t.__name__}'s fields" if dataclasses.is_dataclass(t) else t.__name__ for t in kind)
    raise ValueError(f"{what}: argument {name!r} must be {want}, got {type(value).__name__}")


def record(cls, args: dict, what: str):
    """A map off the wire (an actor's start: actors/starts.py) as the dataclass `cls`: its names checked, then each
    field against its annotation, a dataclass field from the map of its fields; one sentence that names what is
    wrong."""
    names, required = _fields(cls)
    if not (args.keys() <= names and required <= args.keys()):
        raise ValueError(f"{what} takes {', '.join(sorted(names))}: {_why(args, names, required)}")
    hints = _hints(cls)
    return cls(**{k: _check(what, k, _accepted(hints[k]), v) for k, v in args.items()})


@functools.cache
def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


@functools.cache
def signature(fn, op: str) -> Signature:
    """The op's signature from its handler's (`self` aside)."""
    sig = inspect.signature(fn)
    params, names, required, any_ = [], set(), set(), False
    for p in list(sig.parameters.values())[1:]:
        if p.kind is p.VAR_KEYWORD:
            any_ = True
        elif p.name != "tensors":
            params.append((p.name, _accepted(_hint(fn, p)), p.default is not p.empty))
            names.add(p.name)
            if p.default is p.empty:
                required.add(p.name)
    return Signature(op, tuple(params), frozenset(names), frozenset(required), "tensors" in sig.parameters, any_)


def _hint(fn, p: inspect.Parameter):
    """A parameter's annotation, resolved in its handler's module (one that does not resolve: anything goes)."""
    if not isinstance(p.annotation, str):
        return p.annotation
    try:
        return eval(p.annotation, fn.__globals__)  # noqa: S307 - our own annotations, as typing.get_type_hints does
    except Exception:
        return typing.Any


def wire_args(args: dict) -> dict:
    """A call's arguments as the wire carries them: a dataclass as the map of its fields."""
    return {k: _fields_of(v) if dataclasses.is_dataclass(v) and not isinstance(v, type) else v for k, v in args.items()}


def _fields_of(value) -> dict:
    return {f.name: getattr(value, f.name) for f in fields(value)}


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
class DraftCycle:
    """One generation's cycle on the draft actor, in one message (op `cycle`, a batch's in one list): the verdict on
    the last tree it grew (`path`: the accepted nodes, `new`: the tokens committed; `path` None: no tree of the
    draft's was verified since), the tokens committed since without a tree of its own (`behind`: plain steps, the
    trie's candidates), then the next tree: at most `budget` nodes (0: none, the verdict alone), the trie's
    candidates alone where `lookup`, and at most `ahead` draft forwards run on from it after the reply, while the
    target verifies it, until the next message arrives (LLMCad 3.4)."""

    slot: int = 0
    path: list | None = None
    new: list = dataclasses.field(default_factory=list)
    behind: list = dataclasses.field(default_factory=list)
    budget: int = 0
    lookup: bool = False
    ahead: int = 0


@dataclass(frozen=True)
class Drafted:
    """The draft actor's answer to a batch's cycles (op `cycle`), in the order asked: each the map of its `Tree`'s
    fields (None where no tree was asked), and drafting ahead's counts so far in that generation (forwards run
    ahead, tree nodes that reused them)."""

    trees: list
    ahead: list


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


@dataclass(frozen=True)
class Batched:
    """A batch of generations' calls answered (speculative/batch.py), each as its own call would be: a start's
    [token, reused], a step's token, a verification's [accepted path, next token]."""

    results: list


REPLIES: dict[str, type] = {
    "token": Token,
    "batched": Batched,
    "drafted": Drafted,
    "verdict": Verdict,
    "await_group": AwaitGroup,
    "await_experts": AwaitExperts,
    "tree": Tree,
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
