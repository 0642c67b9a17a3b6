"""Linear layers per weight format: how a float weight is stored, and how it multiplies.

Every format takes fp32 activations [T, K] and returns fp32 [T, N]. On the CPU the product runs
in cadence's own kernel (models/csrc/linear.cpp), whose result for a row never depends on the
other rows of the batch; elsewhere (CUDA) in torch. Formats:
  fp32, bf16, fp16   dense weights
  int8               weight-only, symmetric, one fp32 scale per output channel
  int4               weight-only, groups of 32 with 8-bit scale and minimum under fp16 scales per 256
                     (llama.cpp's Q4_K layout, with 8-bit instead of 6-bit sub-scales)
  int2               as int4 with 2-bit codes (models/linear_int2.py): a single expert's format (expert-wise
                     bitwidths), or a model's FFN products in the model format int2, whose attention and
                     head stay int4 (formats/convert.py `linear_format`: in 2 bits they cost a draft most
                     of its agreement with the target, its FFN a little)
Quantized formats multiply in integers: activations are rounded to int8 per block of 256 per row.
Their arrays are stored in tiles of 16 output rows (models/tiles.py), the layout the kernels read.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from common.errors import CadenceError
from common.settings import FORMATS, check_format
from models import kernels, linear_int2, tiles

FLOAT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_KERNEL_FMT = {torch.float32: kernels.F32, torch.bfloat16: kernels.BF16, torch.float16: kernels.F16}
SUB, SUPER = 32, 256  # int4 sub-block and super-block; activations are quantized per super-block
ACT_BLOCK = SUPER


def _use_kernel(t: torch.Tensor, k: int) -> bool:
    return t.device.type == "cpu" and k % 32 == 0 and kernels.available()


class Linear:
    """y = x W^T + b. Subclasses hold W in their format."""

    fmt = ""

    def __init__(self, n: int, k: int, bias: torch.Tensor | None):
        self.n, self.k, self.bias = n, k, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x)
        return y if self.bias is None else y + self.bias

    def matmul(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x W^T (no bias); with `out`, added to it in place: the residual connection."""
        raise NotImplementedError

    def _torch_add(self, y: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        if out is None:
            return y
        out += y
        return out

    def dequantized(self) -> torch.Tensor:
        """W as fp32 [N, K], exactly as this format represents it."""
        raise NotImplementedError

    def rows(self, n0: int, n1: int) -> "Linear":
        """Output columns n0..n1 as a linear of their own (views of the same weights, no copy)."""
        raise NotImplementedError

    def matmul_cols(self, x: torch.Tensor, out: torch.Tensor, n0: int, n1: int, accumulate: bool = False) -> None:
        """Write output columns n0..n1 of x W^T straight into out[:, n0:n1] (or add them there with
        `accumulate`): a column split, where each unit fills its own columns of one shared buffer;
        no all-reduce, no copy. Each column comes out exactly as in the unsplit product."""
        if n1 <= n0:
            return
        part = self.rows(n0, n1)
        if part.kernel:
            part._kernel(x, **({"out": out[:, n0:n1]} if accumulate else {"into": out[:, n0:n1]}))
        elif accumulate:
            out[:, n0:n1] += part.matmul(x)
        else:
            out[:, n0:n1] = part.matmul(x)

    def nbytes(self) -> int:
        raise NotImplementedError


class DenseLinear(Linear):
    def __init__(self, w: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__(w.shape[0], w.shape[1], bias)
        self.w = w
        self.fmt = {v: k for k, v in FLOAT_DTYPES.items()}[w.dtype]
        self.kernel = _use_kernel(w, self.k)

    def matmul(self, x, out=None):
        if self.kernel:
            return self._kernel(x, out=out)
        return self._torch_add(F.linear(x.to(self.w.dtype), self.w).float(), out)

    def _kernel(self, x, **kw):
        raw = self.w if self.w.dtype == torch.float32 else self.w.view(torch.int16)
        return kernels.linear(x, _KERNEL_FMT[self.w.dtype], self.n, self.k, raw, **kw)

    def rows(self, n0, n1):
        return DenseLinear(self.w[n0:n1], None if self.bias is None else self.bias[n0:n1])

    def dequantized(self):
        return self.w.float()

    def nbytes(self):
        return self.w.numel() * self.w.element_size()


class QuantLinear(Linear):
    """int8, int4, int2: arrays in tiles of TILE output rows (models/tiles.py); this linear is the rows
    row0 .. row0 + n of them (a slice of whole tiles: no copy)."""

    kernel_fmt = 0
    names: tuple[str, ...] = ()

    def __init__(
        self,
        arrays: dict[str, torch.Tensor],
        k: int,
        n: int | None = None,
        row0: int = 0,
        bias: torch.Tensor | None = None,
    ):
        room = arrays["q"].shape[0] * tiles.TILE - row0
        super().__init__(room if n is None else min(n, room), k, bias)  # fewer tiles than n rows: a head's first rows
        self.arrays, self.row0 = arrays, row0
        self.kernel = _use_kernel(arrays["q"], k)
        self._dense = None

    def _kernel(self, x, **kw):
        extra = [self.arrays[a] for a in self.names[1:]]
        extra = [a.view(torch.int16) if a.dtype == torch.float16 else a for a in extra]
        return kernels.linear(x, self.kernel_fmt, self.n, self.k, self.arrays["q"], *extra, row0=self.row0, **kw)

    def rows(self, n0, n1):
        a, b = self.row0 + n0, self.row0 + n1
        t0, t1 = a // tiles.TILE, tiles.count(b)
        bias = None if self.bias is None else self.bias[n0:n1]
        return type(self)({k: v[t0:t1] for k, v in self.arrays.items()}, self.k, n1 - n0, a - t0 * tiles.TILE, bias)

    def matmul(self, x, out=None):
        if self.kernel:
            return self._kernel(x, out=out)
        if self._dense is None:  # no kernel here: keep a bf16 copy
            self._dense = self.dequantized().to(torch.bfloat16)
        return self._torch_add(F.linear(x.to(torch.bfloat16), self._dense).float(), out)

    def record(self) -> list[int]:
        """This linear as the expert kernel reads it: format, n, k, row0 and its arrays' addresses."""
        ptrs = [self.arrays[a].data_ptr() for a in self.names] + [0] * (5 - len(self.names))
        return [self.kernel_fmt, self.n, self.k, self.row0, *ptrs]

    def per_row(self) -> dict[str, torch.Tensor]:
        """This linear's arrays per row, codes unpacked."""
        return tiles.unpack(self.fmt, self.arrays, self.k, self.row0, self.n)

    def nbytes(self):
        return sum(a.numel() * a.element_size() for a in self.arrays.values())


class Int8Linear(QuantLinear):
    fmt = "int8"
    kernel_fmt = kernels.Q8
    names = ("q", "scale")

    def dequantized(self):
        a = self.per_row()
        return a["q"].float() * a["scale"][:, None]


class Int4Linear(QuantLinear):
    fmt = "int4"
    kernel_fmt = kernels.Q4
    names = ("q", "sc", "mn", "s", "m")

    def codes(self) -> torch.Tensor:
        """The codes as uint8 [N, K]."""
        return tiles.unpack_codes(self.fmt, self.arrays["q"], self.k, self.row0, self.n)

    def dequantized(self):
        a, ng = self.per_row(), self.k // SUB
        per_group = lambda t: t.float().repeat_interleave(SUPER // SUB, dim=1)[:, :ng]  # super-block value per group
        scale = per_group(a["s"]) * a["sc"].float()  # [N, K/32]
        offset = per_group(a["m"]) * a["mn"].float()
        codes = a["q"].view(self.n, ng, SUB).float()
        return (codes * scale[..., None] - offset[..., None]).view(self.n, self.k)


class Int2Linear(Int4Linear):
    """int2 codes (models/linear_int2.py) with int4's scales: the same arithmetic as Int4Linear."""

    fmt = "int2"
    kernel_fmt = kernels.Q2


def column_split(n: int, share: float) -> int:
    """The first output column a second unit computes when it takes about `share` of n columns: a tile
    boundary of the quantized layouts, so that each unit reads whole tiles."""
    return min(n, int(round(n * (1.0 - share) / tiles.TILE)) * tiles.TILE)


def quantize_int8(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict]:
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return {"q": q, "scale": scale.float()}, {}  # per row; encode puts them in tiles


def quantize_int4(w: torch.Tensor, group: int) -> tuple[dict[str, torch.Tensor], dict]:
    """w ~ S sc q - M mn: codes q 0..15 per weight, 8-bit sc, mn per group of 32, fp16 S, M per 256."""
    n, k = w.shape
    linear_int2.check_group("int4", group, k)
    ng = k // SUB
    wg = w.view(n, k // group, group)
    lo = wg.amin(-1).clamp(max=0)
    hi = wg.amax(-1)
    scale = ((hi - lo) / 15.0).repeat_interleave(group // SUB, dim=1)  # [N, K/32]
    offset = (-lo).repeat_interleave(group // SUB, dim=1)
    sc, s16, scale_q = linear_int2.two_level(scale, n, ng)
    mn, m16, offset_q = linear_int2.two_level(offset, n, ng)
    wq = w.view(n, ng, SUB)
    codes = (
        torch.where(
            scale_q[..., None] > 0,
            torch.round((wq + offset_q[..., None]) / scale_q[..., None].clamp(min=1e-30)),
            torch.zeros_like(wq),
        )
        .clamp(0, 15)
        .to(torch.uint8)
    )
    return {"q": codes.view(n, k), "sc": sc, "mn": mn, "s": s16, "m": m16}, {"group": group}  # per row


def _relative_error(w: torch.Tensor, lin: Linear) -> float:
    return float((lin.dequantized() - w).norm() / w.norm().clamp(min=1e-30))


def encode(w: torch.Tensor, fmt: str, group_size: int = 32) -> tuple[dict[str, torch.Tensor], dict]:
    """A float weight [N, K] in `fmt`: (arrays for the store, metadata incl. round-trip error)."""
    check_format(fmt)
    w = w.float()
    if fmt in FLOAT_DTYPES:
        arrays, meta = {"w": w.to(FLOAT_DTYPES[fmt])}, {}
    elif fmt == "int8":
        arrays, meta = quantize_int8(w)
    elif fmt == "int2":
        arrays, meta = linear_int2.quantize_int2(w, group_size)
    else:
        arrays, meta = quantize_int4(w, group_size)
    if fmt in tiles.QUANTIZED:
        arrays = tiles.pack(fmt, arrays)
        meta.update(n=w.shape[0], tile=tiles.TILE)
    meta["error"] = round(_relative_error(w, decode(fmt, arrays, meta)), 6)
    return arrays, meta


def decode(fmt: str, arrays: dict[str, torch.Tensor], meta: dict, bias: torch.Tensor | None = None) -> Linear:
    check_format(fmt)
    if fmt in FLOAT_DTYPES:
        return DenseLinear(arrays["w"], bias)
    if meta.get("tile", tiles.TILE) != tiles.TILE:
        raise CadenceError(
            f"these weights are in tiles of {meta['tile']} rows, this cadence reads tiles of {tiles.TILE}; "
            "convert the model again"
        )
    cls = {"int8": Int8Linear, "int4": Int4Linear, "int2": Int2Linear}[fmt]
    k = arrays["q"].shape[1] // tiles.TILE if fmt == "int8" else arrays["sc"].shape[1] // tiles.TILE * SUB
    return cls(arrays, k, meta.get("n"), 0, bias)


assert FORMATS == (*FLOAT_DTYPES, "int8", "int4", "int2")


def float_dtype(fmt: str) -> torch.dtype:
    """The dtype a format keeps its embedding in (quantized formats: bf16)."""
    return FLOAT_DTYPES.get(fmt, torch.bfloat16)
