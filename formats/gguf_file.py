"""A fast GGUF header reader; tensor bytes are memory-mapped and dequantized by the `gguf` package.

`gguf.GGUFReader` builds one numpy object per vocabulary entry and takes ~15 s to open a
152k-token file; reading the header directly takes a fraction of a second. Block layouts and
dequantization stay with `gguf` (`GGML_QUANT_SIZES`, `quants.dequantize`).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quant_shape_to_byte_shape

from common.errors import CadenceError

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NP = {
    0: np.uint8,
    1: np.int8,
    2: np.uint16,
    3: np.int16,
    4: np.uint32,
    5: np.int32,
    6: np.float32,
    7: np.bool_,
    10: np.uint64,
    11: np.int64,
    12: np.float64,
}
_STRING, _ARRAY = 8, 9
_HEADER_BYTES = 24  # magic, version, tensor count, field count
_MAX_DIMS = 4  # GGML_MAX_DIMS
_PLAIN = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order: [rows, cols] = [out, in]
    qtype: GGMLQuantizationType
    offset: int  # absolute, in the file
    nbytes: int


class _Damaged(Exception):
    """The header points past the end of the file or holds a value no GGUF file has."""


class _Cursor:
    def __init__(self, buf: memoryview):
        self.buf, self.pos = buf, 0

    def skip(self, n: int) -> int:
        """Step over n bytes and return where they start; a garbled length must not send us past the end."""
        left = len(self.buf) - self.pos
        if not 0 <= n <= left:
            raise _Damaged(f"byte {self.pos} claims {n} bytes but only {left} follow")
        self.pos += n
        return self.pos - n

    def count(self, n: int, min_bytes: int) -> int:
        """A count of items of at least `min_bytes` each: a garbled one fails here, not after a long loop."""
        if n * min_bytes > len(self.buf) - self.pos:
            raise _Damaged(f"byte {self.pos} claims {n} items but only {len(self.buf) - self.pos} bytes follow")
        return n

    def take(self, fmt: str):
        return struct.unpack_from(fmt, self.buf, self.skip(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.take("<Q")
        start = self.skip(n)
        return bytes(self.buf[start : start + n]).decode("utf-8", errors="replace")

    def value(self, vtype: int):
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            itype = self.take("<I")
            n = self.count(self.take("<Q"), 8 if itype == _STRING else 1)
            if itype == _STRING:
                return [self.string() for _ in range(n)]
            if itype in _NP:
                start = self.skip(n * np.dtype(_NP[itype]).itemsize)
                return np.frombuffer(self.buf, dtype=_NP[itype], count=n, offset=start).tolist()
            return [self.value(itype) for _ in range(n)]
        if vtype not in _SCALARS:
            raise _Damaged(f"byte {self.pos} holds value type {vtype}, which GGUF does not have")
        return self.take(_SCALARS[vtype])


class GGUFFile:
    def __init__(self, path: Path):
        self.path = Path(path)
        size = self.path.stat().st_size
        if size < _HEADER_BYTES:  # np.memmap cannot map an empty file, and nothing shorter holds a header
            raise CadenceError(
                f"{self.path} is {'empty' if size == 0 else f'only {size} bytes'}, too short to be a GGUF "
                "model; re-download it or check the path"
            )
        self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        try:
            self._parse(memoryview(self._mm), size)
        except (_Damaged, struct.error, KeyError, ValueError, UnicodeDecodeError, IndexError, OverflowError) as e:
            raise CadenceError(
                f"{self.path} is a damaged GGUF file (its header is unreadable: {e}); re-download it"
            ) from None

    def _parse(self, buf: memoryview, size: int):
        c = _Cursor(buf)
        if bytes(buf[:4]) != b"GGUF":
            raise CadenceError(f"{self.path} is not a GGUF file (bad magic); re-download it")
        c.pos = 4
        version = c.take("<I")
        if version not in (2, 3):
            raise CadenceError(f"{self.path} is GGUF version {version}; cadence reads versions 2 and 3")
        n_tensors, n_kv = c.count(c.take("<Q"), 24), c.count(c.take("<Q"), 12)
        self.fields: dict[str, object] = {}
        for _ in range(n_kv):
            key = c.string()
            self.fields[key] = c.value(c.take("<I"))
        raw = []
        for _ in range(n_tensors):
            name = c.string()
            n_dims = c.take("<I")
            if n_dims > _MAX_DIMS:
                raise _Damaged(f"tensor {name!r} claims {n_dims} dimensions")
            dims = [c.take("<Q") for _ in range(n_dims)]
            raw.append((name, dims, GGMLQuantizationType(c.take("<I")), c.take("<Q")))
        align = self.fields.get("general.alignment", 32)
        if not isinstance(align, int) or align <= 0:
            raise _Damaged(f"the alignment field is {align!r}")
        start = (c.pos + align - 1) // align * align
        self.tensors: dict[str, TensorInfo] = {}
        for name, dims, qtype, off in raw:
            block, tsize = GGML_QUANT_SIZES[qtype]
            n = math.prod(dims)  # exact: a garbled dimension must not wrap around
            self.tensors[name] = TensorInfo(name, tuple(reversed(dims)), qtype, start + off, n // block * tsize)
        end = max((t.offset + t.nbytes for t in self.tensors.values()), default=0)
        if end > size:
            raise CadenceError(
                f"{self.path} is truncated: its tensors need {end} bytes but the file has {size}; re-download it"
            )

    def read(self, name: str, index: int | None = None) -> np.ndarray:
        """The tensor as float32 in numpy order ([out, in] for weights); with `index`, only that entry of
        its outermost dimension (one expert of a [experts, out, in] tensor), read from its own bytes."""
        t = self.tensors[name]
        shape, offset, nbytes = t.shape, t.offset, t.nbytes
        if index is not None:
            if not 0 <= index < shape[0]:
                raise CadenceError(f"{self.path.name}: tensor '{name}' has {shape[0]} entries, not {index + 1}")
            shape, nbytes = shape[1:], t.nbytes // shape[0]
            offset += index * nbytes
        data = self._mm[offset : offset + nbytes]
        if t.qtype in _PLAIN:
            return data.view(_PLAIN[t.qtype]).reshape(shape).astype(np.float32)
        try:
            out = dequantize(data.reshape(quant_shape_to_byte_shape(shape, t.qtype)), t.qtype)
        except NotImplementedError:
            raise CadenceError(
                f"{self.path.name}: tensor '{name}' has type {t.qtype.name}, which cannot be dequantized"
            ) from None
        return np.ascontiguousarray(out, dtype=np.float32).reshape(shape)
