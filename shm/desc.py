"""Tensor descriptors: what travels on the wire instead of tensor bytes. No torch here.

A `TensorDesc` names bytes that already sit in a shared-memory arena; the receiver maps them
with no copy (`shm.tensors.view`). Tensors of at most `INLINE_MAX` bytes may travel inline as an
`InlineTensor` instead. Both are plain frozen dataclasses that pack to short msgpack lists.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# dtype name -> itemsize in bytes; the names are torch's (`str(torch.float32)` without "torch.")
DTYPES = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
}

# Tensors up to this many bytes may travel inline in a message; larger ones go through an arena.
INLINE_MAX = 256

_SEGMENT = re.compile(r"cadence-[0-9a-z]+-[a-z0-9_]+\Z")


def _dims(name: str, value, minimum: int) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or not all(type(v) is int and v >= minimum for v in value):
        raise ValueError(f"{name} must be a list of ints >= {minimum}, got {value!r}")
    return tuple(value)


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


@dataclass(frozen=True)
class TensorDesc:
    """`shape`/`strides` in elements; `offset` in bytes from the start of `segment`."""

    segment: str
    offset: int
    dtype: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]

    def __post_init__(self):
        if not isinstance(self.segment, str) or not _SEGMENT.match(self.segment):
            raise ValueError(f"segment must be a cadence segment name, got {self.segment!r}")
        if type(self.offset) is not int or self.offset < 0:
            raise ValueError(f"offset must be an int >= 0, got {self.offset!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        object.__setattr__(self, "shape", _dims("shape", self.shape, 0))
        object.__setattr__(self, "strides", _dims("strides", self.strides, 0))
        if len(self.shape) != len(self.strides):
            raise ValueError(f"shape {self.shape} and strides {self.strides} differ in length")
        if self.offset % DTYPES[self.dtype]:
            raise ValueError(f"offset {self.offset} is not aligned to a {self.dtype} element")

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype]

    @property
    def span_bytes(self) -> int:
        """Bytes from `offset` that the strided view touches (0 for an empty tensor)."""
        if any(s == 0 for s in self.shape):
            return 0
        last = sum((s - 1) * st for s, st in zip(self.shape, self.strides))
        return (last + 1) * self.itemsize

    def to_wire(self) -> list:
        return [self.segment, self.offset, self.dtype, list(self.shape), list(self.strides)]

    @classmethod
    def from_wire(cls, obj) -> "TensorDesc":
        if not isinstance(obj, list) or len(obj) != 5:
            raise ValueError(f"a tensor descriptor is a list of 5 items, got {obj!r:.80}")
        return cls(*obj)


@dataclass(frozen=True)
class InlineTensor:
    """A small tensor carried in the message itself: row-major bytes."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        object.__setattr__(self, "shape", _dims("shape", self.shape, 0))
        if not isinstance(self.data, bytes):
            raise ValueError(f"inline tensor data must be bytes, got {type(self.data).__name__}")
        want = numel(self.shape) * DTYPES[self.dtype]
        if len(self.data) != want:
            raise ValueError(
                f"inline tensor of shape {self.shape} {self.dtype} needs {want} bytes, got {len(self.data)}"
            )
        if want > INLINE_MAX:
            raise ValueError(f"inline tensors are at most {INLINE_MAX} bytes, got {want}; put it in an arena")

    def to_wire(self) -> list:
        return [self.dtype, list(self.shape), self.data]

    @classmethod
    def from_wire(cls, obj) -> "InlineTensor":
        if not isinstance(obj, list) or len(obj) != 3:
            raise ValueError(f"an inline tensor is a list of 3 items, got {obj!r:.80}")
        return cls(*obj)
