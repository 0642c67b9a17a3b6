"""Linear layers per weight format: how a float weight is stored, and how it multiplies.

Every format takes fp32 activations [T, K] and returns fp32 [T, N]. On the CPU the product runs
in cadence's own kernel (models/csrc/linear.cpp), whose result for a row never depends on the
other rows of the batch; elsewhere (CUDA) in torch. Formats:
  fp32, bf16, fp16   dense weights
  int8               weight-only, symmetric, one fp32 scale per output channel
  int4               weight-only, groups of 32 with 8-bit scale and minimum under fp16 scales per 256
                     (llama.cpp's Q4_K layout, with 8-bit instead of 6-bit sub-scales)
  int2               as int4 with 2-bit codes (models/linear_int2.py); an expert-only format, not in
                     FORMATS (the formats a model is converted to): ALL_FORMATS lists it
Quantized formats multiply in integers: activations are rounded to int8 per block of 256 per row.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from common.errors import CadenceError
from common.settings import FORMATS, check_format
from models import kernels, linear_int2

FLOAT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_KERNEL_FMT = {torch.float32: kernels.F32, torch.bfloat16: kernels.BF16, torch.float16: kernels.F16}
GROUP_SIZES = (32, 64)  # int4 quantization groups; 64 shares one sub-scale across two groups of 32
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


class Int8Linear(Linear):
    fmt = "int8"

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__(q.shape[0], q.shape[1], bias)
        self.q, self.scale = q, scale
        self.kernel = _use_kernel(q, self.k)
        self._dense = None

    def _kernel(self, x, **kw):
        return kernels.linear(x, kernels.Q8, self.n, self.k, self.q, self.scale, **kw)

    def rows(self, n0, n1):
        return Int8Linear(self.q[n0:n1], self.scale[n0:n1], None if self.bias is None else self.bias[n0:n1])

    def matmul(self, x, out=None):
        if self.kernel:
            return self._kernel(x, out=out)
        if self._dense is None:  # no kernel here: keep a bf16 copy
            self._dense = self.dequantized().to(torch.bfloat16)
        return self._torch_add(F.linear(x.to(torch.bfloat16), self._dense).float(), out)

    def dequantized(self):
        return self.q.float() * self.scale[:, None]

    def nbytes(self):
        return self.q.numel() + self.scale.numel() * 4


class Int4Linear(Linear):
    fmt = "int4"
    per_byte = 2  # codes packed in a byte
    kernel_fmt = kernels.Q4

    def __init__(self, q: torch.Tensor, sc: torch.Tensor, mn: torch.Tensor, s: torch.Tensor, m: torch.Tensor,
                 bias: torch.Tensor | None = None):
        super().__init__(q.shape[0], q.shape[1] * self.per_byte, bias)
        self.q, self.sc, self.mn, self.s, self.m = q, sc, mn, s, m
        self.kernel = _use_kernel(q, self.k)
        self._dense = None

    def _kernel(self, x, **kw):
        return kernels.linear(x, self.kernel_fmt, self.n, self.k, self.q, self.sc, self.mn, self.s.view(torch.int16),
                              self.m.view(torch.int16), **kw)

    def rows(self, n0, n1):
        b = None if self.bias is None else self.bias[n0:n1]
        return type(self)(self.q[n0:n1], self.sc[n0:n1], self.mn[n0:n1], self.s[n0:n1], self.m[n0:n1], b)

    def matmul(self, x, out=None):
        if self.kernel:
            return self._kernel(x, out=out)
        if self._dense is None:
            self._dense = self.dequantized().to(torch.bfloat16)
        return self._torch_add(F.linear(x.to(torch.bfloat16), self._dense).float(), out)

    def codes(self) -> torch.Tensor:
        """The 4-bit codes as uint8 [N, K]."""
        b = self.q.view(self.n, self.k // SUB, SUB // 2)
        return torch.cat([b & 15, b >> 4], dim=-1).view(self.n, self.k)

    def dequantized(self):
        ng = self.k // SUB
        per_group = lambda t: t.float().repeat_interleave(SUPER // SUB, dim=1)[:, :ng]  # super-block value per group
        scale = per_group(self.s) * self.sc.float()  # [N, K/32]
        offset = per_group(self.m) * self.mn.float()
        codes = self.codes().view(self.n, ng, SUB).float()
        return (codes * scale[..., None] - offset[..., None]).view(self.n, self.k)

    def nbytes(self):
        return self.q.numel() + self.sc.numel() + self.mn.numel() + (self.s.numel() + self.m.numel()) * 2


class Int2Linear(Int4Linear):
    """int2 codes (4 per byte, models/linear_int2.py) with int4's scales: the same arithmetic as Int4Linear."""
    fmt = "int2"
    per_byte = 4
    kernel_fmt = kernels.Q2

    def codes(self) -> torch.Tensor:
        """The 2-bit codes as uint8 [N, K]."""
        return linear_int2.unpack(self.q)


def column_split(n: int, share: float) -> int:
    """The first output column a second unit computes when it takes `share` of n columns."""
    return n - int(round(n * share))


def quantize_int8(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict]:
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return {"q": q, "scale": scale.float()}, {}


def quantize_int4(w: torch.Tensor, group: int) -> tuple[dict[str, torch.Tensor], dict]:
    """w ~ S sc q - M mn: codes q 0..15 per weight, 8-bit sc, mn per group of 32, fp16 S, M per 256."""
    n, k = w.shape
    if group not in GROUP_SIZES:
        raise CadenceError(f"int4 group size {group} is not supported; use 32 or 64")
    if k % group:
        raise CadenceError(f"int4 with groups of {group} needs the input width ({k}) to be a multiple of {group}; try --group-size 32")
    ng = k // SUB
    wg = w.view(n, k // group, group)
    lo = wg.amin(-1).clamp(max=0)
    hi = wg.amax(-1)
    scale = ((hi - lo) / 15.0).repeat_interleave(group // SUB, dim=1)  # [N, K/32]
    offset = (-lo).repeat_interleave(group // SUB, dim=1)
    sc, s16, scale_q = linear_int2.two_level(scale, n, ng)
    mn, m16, offset_q = linear_int2.two_level(offset, n, ng)
    wq = w.view(n, ng, SUB)
    codes = torch.where(scale_q[..., None] > 0, torch.round((wq + offset_q[..., None]) / scale_q[..., None].clamp(min=1e-30)),
                        torch.zeros_like(wq)).clamp(0, 15).to(torch.uint8)
    packed = (codes[..., :SUB // 2] | (codes[..., SUB // 2:] << 4)).reshape(n, k // 2).contiguous()
    return {"q": packed, "sc": sc, "mn": mn, "s": s16, "m": m16}, {"group": group}


def _relative_error(w: torch.Tensor, lin: Linear) -> float:
    return float((lin.dequantized() - w).norm() / w.norm().clamp(min=1e-30))


def encode(w: torch.Tensor, fmt: str, group_size: int = 32) -> tuple[dict[str, torch.Tensor], dict]:
    """A float weight [N, K] in `fmt`: (arrays for the store, metadata incl. round-trip error)."""
    check_any_format(fmt)
    w = w.float()
    if fmt in FLOAT_DTYPES:
        arrays, meta = {"w": w.to(FLOAT_DTYPES[fmt])}, {}
    elif fmt == "int8":
        arrays, meta = quantize_int8(w)
    elif fmt == "int2":
        arrays, meta = linear_int2.quantize_int2(w, group_size)
    else:
        arrays, meta = quantize_int4(w, group_size)
    meta["error"] = round(_relative_error(w, decode(fmt, arrays, meta)), 6)
    return arrays, meta


def decode(fmt: str, arrays: dict[str, torch.Tensor], meta: dict, bias: torch.Tensor | None = None) -> Linear:
    check_any_format(fmt)
    if fmt in FLOAT_DTYPES:
        return DenseLinear(arrays["w"], bias)
    if fmt == "int8":
        return Int8Linear(arrays["q"], arrays["scale"], bias)
    if fmt == "int2":
        return Int2Linear(arrays["q"], arrays["sc"], arrays["mn"], arrays["s"], arrays["m"], bias)
    return Int4Linear(arrays["q"], arrays["sc"], arrays["mn"], arrays["s"], arrays["m"], bias)


EXPERT_FORMATS = ("int2",)  # formats for single experts of a mixture, never for a whole model
ALL_FORMATS = (*FORMATS, *EXPERT_FORMATS)
assert FORMATS == (*FLOAT_DTYPES, "int8", "int4")


def check_any_format(fmt: str) -> str:
    """check_format, also letting the expert-only formats through."""
    return fmt if fmt in EXPERT_FORMATS else check_format(fmt)


def float_dtype(fmt: str) -> torch.dtype:
    """The dtype a format keeps its embedding in (quantized formats: bf16)."""
    return FLOAT_DTYPES.get(fmt, torch.bfloat16)
