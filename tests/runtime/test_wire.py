"""Wire: every message round-trips; tensors of every dtype round-trip through descriptors or
inline; anything malformed is a WireError that says what is wrong; pickle is never involved."""

from __future__ import annotations

import pickle

import msgpack
import pytest
import torch

from actors import wire
from shm.arena import Arena, new_run_id
from common.settings import TreeConfig
from speculative.tree import Tree
from shm.desc import DTYPES, INLINE_MAX, InlineTensor, TensorDesc
from shm.tensors import from_inline, put, to_inline, view

DTYPE_LIST = [getattr(torch, n) for n in DTYPES]


@pytest.fixture(scope="module")
def arena():
    a = Arena.create(new_run_id(), "wire", 80 << 20)
    yield a
    a.close()
    a.unlink()


def roundtrip(msg):
    frames = wire.encode(msg)
    assert len(frames) == 2 and len(frames[0]) == 1
    assert b"pickle" not in frames[1] and not frames[1].startswith(b"\x80")  # a pickle starts with PROTO 0x80
    return wire.decode(frames)


SAMPLE = [
    wire.Hello("verifier", 1234),
    wire.Init(
        {"seed": 3, "nested": {"a": [1, 2.5, "x", b"\x00", None, True]}}, ["cadence-1x0a-main"], 10**12, 0.25, True
    ),
    wire.Ready("draft", "FakeDraftActor", ["ping", "build"]),
    wire.Heartbeat(5),
    wire.Stop("shutdown"),
    wire.Dead("loader", "crashed: OSError: disk gone"),
    wire.TraceBatch(99, [{"ph": "X", "name": "load", "ts": 1, "dur": 2, "tid": 3}]),
    wire.Error(None, "bad"),
    wire.Error(7, "bad request"),
    wire.Request("layer", {"group": "layer.3"}, {}, 42, None),
    wire.Reply(42, True, {"accepted": 2}, {}, None),
    wire.Reply(43, False, {}, {}, "ValueError: nope"),
]


@pytest.mark.parametrize("msg", SAMPLE, ids=lambda m: type(m).__name__)
def test_every_message_roundtrips(msg):
    assert roundtrip(msg) == msg


@pytest.mark.parametrize("dtype", DTYPE_LIST, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (7,), (33, 17)], ids=str)
def test_tensors_roundtrip_through_the_arena_for_every_dtype(arena, dtype, shape):
    g = torch.Generator().manual_seed(0)
    t = (torch.randn(shape, generator=g) * 50).to(dtype)
    desc = put(arena, 4096, t)
    got = roundtrip(wire.Request("x", {}, {"t": desc}, 1, None)).tensors["t"]
    assert isinstance(got, TensorDesc) and got == desc
    out = view(arena, got)
    assert out.dtype == dtype and out.shape == t.shape and torch.equal(out, t)


@pytest.mark.parametrize("dtype", DTYPE_LIST, ids=str)
def test_small_tensors_travel_inline(dtype):
    t = torch.arange(6).reshape(2, 3).to(dtype)
    it = to_inline(t.t())  # non-contiguous, and bf16 bytes that numpy cannot name
    got = roundtrip(wire.Reply(1, True, {}, {"t": it, "s": to_inline(torch.tensor(5, dtype=dtype))}, None)).tensors
    assert torch.equal(from_inline(got["t"]), t.t())
    assert from_inline(got["s"]).shape == () and from_inline(got["s"]).item() == torch.tensor(5, dtype=dtype).item()


def test_large_and_non_contiguous_tensors_go_by_descriptor(arena):
    big = torch.randn(4096, 4096)[:, ::2]  # 32 MiB of a 64 MiB base, non-contiguous
    assert not big.is_contiguous()
    with pytest.raises(ValueError, match="too large to travel inline"):
        to_inline(big)
    desc = put(arena, 0, big)
    frames = wire.encode(wire.Request("x", {}, {"w": desc}, 1, None))
    assert len(frames[1]) < 200  # the message carries the descriptor, not the bytes
    assert torch.equal(view(arena, wire.decode(frames).tensors["w"]), big)


def test_inline_limit_is_enforced_on_decode_too():
    body = msgpack.packb(
        {
            "req_id": 1,
            "ok": True,
            "result": {},
            "error": None,
            "tensors": {"t": msgpack.ExtType(2, msgpack.packb(["uint8", [INLINE_MAX + 1], b"\0" * (INLINE_MAX + 1)]))},
        }
    )
    with pytest.raises(wire.WireError, match="at most 256 bytes"):
        wire.decode([bytes([wire.Reply.TYPE]), body])


@pytest.mark.parametrize(
    "frames, match",
    [
        ([b"\x10"], "expected 2 frames"),
        ([b"\x10", b"", b""], "expected 2 frames"),
        ([b"\x10\x10", b"\x80"], "type frame must be 1 byte"),
        ([b"\xee", b"\x80"], "unknown message type 238"),
        ([b"\x10", b"\xc1"], "Request body cannot be decoded"),
        ([b"\x10", msgpack.packb([1, 2])], "body must be a map"),
        ([b"\x10", msgpack.packb({"op": "x", "args": {}, "tensors": {}, "req_id": 1})], "missing field 'flow_id'"),
        (
            [b"\x10", msgpack.packb({"op": 5, "args": {}, "tensors": {}, "req_id": 1, "flow_id": None})],
            "Request.op must be str, got int",
        ),
        (
            [b"\x10", msgpack.packb({"op": "x", "args": {}, "tensors": {}, "req_id": True, "flow_id": None})],
            "req_id must be int, got bool",
        ),
        (
            [b"\x10", msgpack.packb({"op": "x", "args": {}, "tensors": {"a": 1}, "req_id": 1, "flow_id": None})],
            "tensor descriptors",
        ),
        (
            [b"\x10", msgpack.packb({"op": "x", "args": {}, "tensors": {}, "req_id": 1, "flow_id": None, "evil": 1})],
            "unknown field",
        ),
        (
            [b"\x10", msgpack.packb({"op": "x", "args": {}, "tensors": {}, "req_id": 1, "flow_id": None, 1: 2})],
            "cannot be decoded",
        ),
        (
            [
                b"\x10",
                msgpack.packb(
                    {"op": "x", "args": {}, "tensors": {"t": msgpack.ExtType(9, b"")}, "req_id": 1, "flow_id": None}
                ),
            ],
            "unknown msgpack ext type",
        ),
        (
            [
                b"\x10",
                msgpack.packb(
                    {
                        "op": "x",
                        "args": {},
                        "tensors": {"t": msgpack.ExtType(1, msgpack.packb(["/etc/passwd", 0, "uint8", [1], [1]]))},
                        "req_id": 1,
                        "flow_id": None,
                    }
                ),
            ],
            "segment name",
        ),
        ([b"\x10", b"\x91" * 100_000], "cannot be decoded"),  # nested too deep
        ([b"\x10", pickle.dumps({"op": "x"})], "cannot be decoded"),  # a pickle is just garbage here
    ],
)
def test_malformed_frames_raise_a_readable_wire_error(frames, match):
    with pytest.raises(wire.WireError, match=match):
        wire.decode(frames)


def test_encode_refuses_what_msgpack_cannot_hold():
    with pytest.raises(wire.WireError, match="set is not msgpack-able"):
        wire.encode(wire.Request("x", {"s": {1, 2}}, {}, 1, None))
    with pytest.raises(wire.WireError, match="Tensor is not msgpack-able"):
        wire.encode(wire.Request("x", {"t": torch.zeros(2)}, {}, 1, None))


def test_descriptor_validation_names_the_field():
    with pytest.raises(ValueError, match="dtype must be one of"):
        TensorDesc("cadence-1x0a-main", 0, "complex64", (1,), (1,))
    with pytest.raises(ValueError, match="not aligned"):
        TensorDesc("cadence-1x0a-main", 2, "float32", (1,), (1,))
    with pytest.raises(ValueError, match="differ in length"):
        TensorDesc("cadence-1x0a-main", 0, "float32", (1, 2), (1,))
    with pytest.raises(ValueError, match="needs 4 bytes"):
        InlineTensor("float32", (1,), b"\0")


def test_a_request_with_an_argument_missing_unknown_or_of_the_wrong_type_fails_in_one_sentence():
    """An op's type is its handler's signature (actors/calls.py): the map on the wire must bind to it exactly,
    each value of its parameter's type; a dataclass parameter takes the map of its fields."""
    from actors.calls import signature, wire_args

    class Ops:
        def op_build(self, budget: int, tensors: dict):
            return budget

        def op_verify(self, tree: Tree, strict: bool = True):
            return tree

        def op_rate(self, gbps: float, name: str | None = None):
            return gbps

        def op_start(self, first: int, tree: TreeConfig | None = None):
            return tree

    build = signature(Ops.op_build, "build")
    assert build.bind({"budget": 4}, {"slot": 1}) == {"budget": 4, "tensors": {"slot": 1}}
    with pytest.raises(
        ValueError, match="op 'build' takes budget: unknown argument\\(s\\) width; missing argument\\(s\\) budget"
    ):
        build.bind({"width": 4}, {})
    with pytest.raises(ValueError, match="op 'build': argument 'budget' must be int, got str"):
        build.bind({"budget": "4"}, {})
    with pytest.raises(ValueError, match="op 'build': argument 'budget' must be int, got bool"):
        build.bind({"budget": True}, {})
    tree = Tree(-1, [5, 6], [-1, 0], [0.9, 0.8])
    verify = signature(Ops.op_verify, "verify")
    assert verify.bind(wire_args({"tree": tree}), {}) == {"tree": tree}  # a dataclass travels as its fields
    with pytest.raises(
        ValueError, match="argument 'tree' \\(Tree\\) takes root, tokens.*missing argument\\(s\\) probs"
    ):
        verify.bind({"tree": {"root": 1, "tokens": [], "parents": []}}, {})
    rate = signature(Ops.op_rate, "rate")
    assert rate.bind({"gbps": 2}, {}) == {"gbps": 2.0} and rate.bind({"gbps": 1.5, "name": None}, {})["name"] is None
    start = signature(Ops.op_start, "start")  # an optional dataclass: its map, or nothing
    assert start.bind(wire_args({"first": 1, "tree": TreeConfig(width=5)}), {})["tree"] == TreeConfig(width=5)
    assert start.bind({"first": 1, "tree": None}, {})["tree"] is None
    with pytest.raises(ValueError, match="argument 'tree' must be a map of TreeConfig's fields or NoneType, got list"):
        start.bind({"first": 1, "tree": [5]}, {})
