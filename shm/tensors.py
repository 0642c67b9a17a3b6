"""Torch tensors in and out of an arena: one copy in (`put`), zero copies out (`view`).

`put` lays the tensor out contiguously, whatever its strides (bf16 and non-contiguous
sources included), so the copy in is the only copy. `view` maps a descriptor with
`torch.frombuffer` + `as_strided`, so a descriptor may also describe a strided view (a
transpose, a slice) of bytes that are already there.
"""

from __future__ import annotations

import numpy as np
import torch

from shm.arena import Arena
from shm.desc import DTYPES, INLINE_MAX, InlineTensor, TensorDesc, contiguous_strides
from shm.slots import Slot

__all__ = ["TensorDesc", "InlineTensor", "put", "view", "to_inline", "from_inline", "dtype_name", "torch_dtype"]

_TORCH = {name: getattr(torch, name) for name in DTYPES}
_NAMES = {v: k for k, v in _TORCH.items()}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot travel between actors; use one of {', '.join(DTYPES)}") from None


def torch_dtype(name: str) -> torch.dtype:
    return _TORCH[name]


def _raw(arena: Arena, offset: int, dtype: torch.dtype, count: int) -> torch.Tensor:
    # uint8 first, then reinterpret: frombuffer's own dtype path is fine too, but this one
    # gives a single bounds check in bytes for every dtype
    itemsize = DTYPES[_NAMES[dtype]]
    return torch.frombuffer(arena.buf, dtype=torch.uint8, count=count * itemsize, offset=offset).view(dtype)


def put(arena: Arena, at: Slot | TensorDesc | int, tensor: torch.Tensor) -> TensorDesc:
    """Copy `tensor` into the arena at a slot, the slot a descriptor from the scheduler spans, or a
    byte offset, and describe it."""
    name = dtype_name(tensor.dtype)
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if isinstance(at, TensorDesc) and at.segment != arena.name:
        raise ValueError(f"descriptor points into {at.segment}, not {arena.name}")
    offset = at.offset if isinstance(at, (Slot, TensorDesc)) else int(at)
    nbytes = t.numel() * t.element_size()
    room = at.nbytes if isinstance(at, Slot) else at.span_bytes if isinstance(at, TensorDesc) else arena.nbytes - offset
    if nbytes > room or offset < 0 or offset + nbytes > arena.nbytes:
        raise ValueError(f"a {nbytes}-byte tensor does not fit at offset {offset} ({room} bytes there) in {arena.name}")
    shape = tuple(t.shape)
    if nbytes and t.is_contiguous():
        # a plain single-threaded memcpy: torch's copy_ goes parallel above 32K elements, and its
        # OpenMP workers stall for milliseconds when other processes hold the cores
        src = t.reshape(-1).view(torch.uint8).numpy()  # bytes, so bf16 works too
        np.copyto(np.frombuffer(arena.buf, dtype=np.uint8, count=nbytes, offset=offset), src)
    elif nbytes:
        # copy_ walks the source strides, so a non-contiguous tensor is compacted in this one copy
        _raw(arena, offset, t.dtype, t.numel()).view(shape).copy_(t)
    return TensorDesc(arena.name, offset, name, shape, contiguous_strides(shape))


def view(arena: Arena, desc: TensorDesc) -> torch.Tensor:
    """A tensor over the arena's bytes: no copy; writes show in every process that maps it."""
    if desc.segment != arena.name:
        raise ValueError(f"descriptor points into {desc.segment}, not {arena.name}")
    dtype = _TORCH[desc.dtype]
    span = desc.span_bytes
    if span == 0:
        return torch.empty(desc.shape, dtype=dtype)
    if desc.offset + span > arena.nbytes:
        raise ValueError(
            f"descriptor reaches byte {desc.offset + span} past the end of {arena.name} ({arena.nbytes} bytes)"
        )
    flat = _raw(arena, desc.offset, dtype, span // desc.itemsize)
    return flat.as_strided(desc.shape, desc.strides)


def to_inline(tensor: torch.Tensor) -> InlineTensor:
    t = tensor.detach().cpu().contiguous()
    nbytes = t.numel() * t.element_size()
    if nbytes > INLINE_MAX:
        raise ValueError(f"a {nbytes}-byte tensor is too large to travel inline (max {INLINE_MAX}); put it in an arena")
    # view as uint8 so bf16 (which numpy lacks) serialises too
    data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if nbytes else b""
    return InlineTensor(dtype_name(t.dtype), tuple(t.shape), data)


def from_inline(it: InlineTensor) -> torch.Tensor:
    dtype = _TORCH[it.dtype]
    if not it.data:
        return torch.empty(it.shape, dtype=dtype)
    return torch.frombuffer(bytearray(it.data), dtype=torch.uint8).view(dtype).reshape(it.shape)


def as_tensor(arena_for: dict[str, Arena], value: TensorDesc | InlineTensor) -> torch.Tensor:
    """Either kind of wire tensor as a torch tensor; descriptors resolve through `arena_for`."""
    if isinstance(value, InlineTensor):
        return from_inline(value)
    return view(arena_for[value.segment], value)
