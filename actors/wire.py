"""Messages between the scheduler and its actors: small frozen dataclasses, msgpack, never pickle.

A message is two ZeroMQ frames: one byte of type, then a msgpack map of the dataclass fields.
Tensors travel as `TensorDesc` (bytes already in an arena) or, up to `INLINE_MAX` bytes, as an
`InlineTensor`; both are msgpack ext types. `decode` checks everything it is given and raises a
`WireError` (one readable sentence) for anything malformed; the receiver logs it, answers with an
`Error`, and keeps serving.

Real actors add operations through `Request.op` / `Reply.result` (an op's arguments checked against its
handler's signature, reply dataclasses: actors/calls.py), not through new message types.
"""

import typing
from dataclasses import dataclass, field, fields
from typing import ClassVar, Union

import msgpack
import zmq

from common.errors import CadenceError
from shm.desc import InlineTensor, TensorDesc

MAX_BODY = 64 << 20  # a control message larger than this is a bug, not a message

_EXT_DESC, _EXT_INLINE = 1, 2


_MISSING = object()


class WireError(CadenceError):
    """A frame that is not a valid message."""


class Msg:
    TYPE: ClassVar[int] = 0


@dataclass(frozen=True)
class Hello(Msg):
    TYPE: ClassVar[int] = 1
    role: str
    pid: int


@dataclass(frozen=True)
class Init(Msg):
    TYPE: ClassVar[int] = 2
    init: dict
    arenas: list  # segment names to attach
    t0_ns: int  # the run's zero on the shared monotonic clock
    heartbeat_s: float  # send a heartbeat at least this often
    trace: bool


@dataclass(frozen=True)
class Ready(Msg):
    TYPE: ClassVar[int] = 3
    role: str
    actor: str  # class name, for the trace
    ops: list


@dataclass(frozen=True)
class Heartbeat(Msg):
    TYPE: ClassVar[int] = 4
    ts_ns: int


@dataclass(frozen=True)
class Stop(Msg):
    TYPE: ClassVar[int] = 5
    reason: str = "stop"


@dataclass(frozen=True)
class Dead(Msg):
    """The actor's last word: `reason` completes "the <role> actor ..."."""

    TYPE: ClassVar[int] = 6
    role: str
    reason: str


@dataclass(frozen=True)
class TraceBatch(Msg):
    TYPE: ClassVar[int] = 7
    pid: int
    events: list  # Trace Event Format dicts, ts/dur in ns on the monotonic clock


@dataclass(frozen=True)
class Error(Msg):
    """An answer to a frame that could not be handled; `req_id` when it was a known request."""

    TYPE: ClassVar[int] = 8
    req_id: Union[int, None]
    message: str


@dataclass(frozen=True)
class Request(Msg):
    TYPE: ClassVar[int] = 16
    op: str
    args: dict = field(default_factory=dict)
    tensors: dict = field(default_factory=dict)  # name -> TensorDesc | InlineTensor
    req_id: int = 0
    flow_id: Union[int, None] = None  # ties the actor's span to the request in the trace


@dataclass(frozen=True)
class Reply(Msg):
    TYPE: ClassVar[int] = 17
    req_id: int
    ok: bool
    result: dict = field(default_factory=dict)
    tensors: dict = field(default_factory=dict)
    error: Union[str, None] = None

    @property
    def value(self):
        """The result as the reply dataclass it was sent as (actors/calls.py REPLIES), or the map."""
        from actors.calls import read_reply

        return read_reply(self.result)


TYPES: dict[int, type] = {
    c.TYPE: c for c in (Hello, Init, Ready, Heartbeat, Stop, Dead, TraceBatch, Error, Request, Reply)
}


def _accepted(hint) -> tuple:
    if typing.get_origin(hint) is Union:
        return tuple(t for h in typing.get_args(hint) for t in _accepted(h))
    if hint is type(None):
        return (type(None),)
    return (typing.get_origin(hint) or hint,)


# per type: (field name, accepted python types) in declaration order. msgpack hands back exact
# types (dict, list, str, bytes, int, float, bool, None), so decode checks `type(v) in types`,
# which also keeps True out of an int field.
_SCHEMA = {c: tuple((f.name, _accepted(typing.get_type_hints(c)[f.name])) for f in fields(c)) for c in TYPES.values()}
_HEAD = {c: bytes([c.TYPE]) for c in TYPES.values()}
_MORE = int(zmq.SNDMORE)  # pyzmq's flag enums cost microseconds per operation; ints do not


def _default(obj):
    if isinstance(obj, TensorDesc):
        return msgpack.ExtType(_EXT_DESC, msgpack.packb(obj.to_wire()))
    if isinstance(obj, InlineTensor):
        return msgpack.ExtType(_EXT_INLINE, msgpack.packb(obj.to_wire(), use_bin_type=True))
    if isinstance(obj, tuple):
        return list(obj)
    raise TypeError(f"{type(obj).__name__} is not msgpack-able")


def _ext_hook(code: int, data: bytes):
    if code == _EXT_DESC:
        return TensorDesc.from_wire(msgpack.unpackb(data, raw=False))
    if code == _EXT_INLINE:
        return InlineTensor.from_wire(msgpack.unpackb(data, raw=False))
    raise ValueError(f"unknown msgpack ext type {code}")


def encode(msg: Msg) -> list[bytes]:
    """Two frames: the type byte and the msgpack body. Raises WireError for a body msgpack cannot hold."""
    cls = type(msg)
    try:
        body = msgpack.packb(msg.__dict__, default=_default, use_bin_type=True)  # the fields, in order
    except (TypeError, ValueError, OverflowError) as e:
        raise WireError(
            f"cannot encode {cls.__name__}: {e} (send plain dicts, lists, numbers, strings, bytes and tensor descriptors)"
        ) from None
    return [_HEAD[cls], body]


def decode(frames: list) -> Msg:
    """Frames (bytes or zmq.Frame) -> a message, or WireError saying what is wrong."""
    if len(frames) != 2:
        raise WireError(f"malformed message: expected 2 frames (type, body), got {len(frames)}")
    head, body = bytes(frames[0]), frames[1]
    if len(head) != 1:
        raise WireError(f"malformed message: the type frame must be 1 byte, got {len(head)}")
    cls = TYPES.get(head[0])
    if cls is None:
        raise WireError(f"unknown message type {head[0]}")
    body = bytes(body)
    if len(body) > MAX_BODY:
        raise WireError(f"{cls.__name__} body of {len(body)} bytes exceeds {MAX_BODY}")
    try:
        obj = msgpack.unpackb(body, raw=False, strict_map_key=True, ext_hook=_ext_hook)
    except Exception as e:  # msgpack raises many types (ExtraData, FormatError, StackError, ValueError, ...)
        raise WireError(f"{cls.__name__} body cannot be decoded: {type(e).__name__}: {e}"[:300]) from None
    if not isinstance(obj, dict):
        raise WireError(f"{cls.__name__} body must be a map, got {type(obj).__name__}")
    kwargs = {}
    for name, types in _SCHEMA[cls]:
        value = obj.pop(name, _MISSING)
        if type(value) not in types:
            if value is _MISSING:
                raise WireError(f"{cls.__name__} is missing field '{name}'")
            if type(value) is int and float in types:
                value = float(value)
            else:
                raise WireError(
                    f"{cls.__name__}.{name} must be {' or '.join(t.__name__ for t in types)}, got {type(value).__name__}"
                )
        kwargs[name] = value
    if obj:
        raise WireError(f"{cls.__name__} has unknown field(s) {', '.join(map(str, obj))}")
    tensors = kwargs.get("tensors")
    if tensors and not all(type(v) in (TensorDesc, InlineTensor) for v in tensors.values()):
        raise WireError(f"{cls.__name__}.tensors values must be tensor descriptors or inline tensors")
    msg = object.__new__(cls)  # every field checked above: skip the frozen __init__'s setattr calls
    msg.__dict__.update(kwargs)
    return msg


def recv(sock, flags: int = 0) -> list[bytes]:
    """recv_multipart without a getsockopt per frame (each one builds an enum in pyzmq)."""
    f = sock.recv(flags, copy=False)
    parts = [f.bytes]
    while f.more:
        f = sock.recv(flags, copy=False)
        parts.append(f.bytes)
    return parts


def send(sock, frames: list, prefix: bytes | None = None) -> None:
    """send_multipart without its per-frame enum arithmetic; `prefix` is a ROUTER's peer identity."""
    if prefix is not None:
        sock.send(prefix, _MORE)
    for f in frames[:-1]:
        sock.send(f, _MORE)
    sock.send(frames[-1])
