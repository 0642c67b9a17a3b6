"""Linear layers per weight format: how a float weight is stored, and how it multiplies.

Every format takes fp32 activations [T, K] and returns fp32 [T, N]. On the CPU the product runs
in cadence's own kernel (models/csrc/linear.cpp), whose result for a row never depends on the
other rows of the batch; elsewhere (CUDA) in torch. Formats:
  fp32, bf16, fp16   dense weights
  int8               weight-only, symmetric, one fp32 scale per output channel
  int4               weight-only, asymmetric groups of G (32 or 64) with fp16 scale and minimum
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from cadence.errors import CadenceError
from models import kernels

FLOAT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_KERNEL_FMT = {torch.float32: kernels.F32, torch.bfloat16: kernels.BF16, torch.float16: kernels.F16}
GROUP_SIZES = (32, 64)


def _use_kernel(t: torch.Tensor, k: int) -> bool:
    return t.device.type == "cpu" and k % 16 == 0 and kernels.available()


class Linear:
    """y = x W^T + b. Subclasses hold W in their format."""
    fmt = ""

    def __init__(self, n: int, k: int, bias: torch.Tensor | None):
        self.n, self.k, self.bias = n, k, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x)
        return y if self.bias is None else y + self.bias

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dequantized(self) -> torch.Tensor:
        """W as fp32 [N, K], exactly as this format represents it."""
        raise NotImplementedError

    def nbytes(self) -> int:
        raise NotImplementedError


class DenseLinear(Linear):
    def __init__(self, w: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__(w.shape[0], w.shape[1], bias)
        self.w = w
        self.fmt = {v: k for k, v in FLOAT_DTYPES.items()}[w.dtype]
        self.kernel = _use_kernel(w, self.k)

    def matmul(self, x):
        if self.kernel:
            raw = self.w if self.w.dtype == torch.float32 else self.w.view(torch.int16)
            return kernels.linear(x, _KERNEL_FMT[self.w.dtype], self.n, self.k, raw)
        return F.linear(x.to(self.w.dtype), self.w).float()

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

    def matmul(self, x):
        if self.kernel:
            return kernels.linear(x, kernels.Q8, self.n, self.k, self.q, scale=self.scale)
        if self._dense is None:  # no kernel here: keep a bf16 copy
            self._dense = self.dequantized().to(torch.bfloat16)
        return F.linear(x.to(torch.bfloat16), self._dense).float()

    def dequantized(self):
        return self.q.float() * self.scale[:, None]

    def nbytes(self):
        return self.q.numel() + self.scale.numel() * 4


class Int4Linear(Linear):
    fmt = "int4"

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, group: int,
                 bias: torch.Tensor | None = None):
        super().__init__(q.shape[0], q.shape[1] * 2, bias)
        self.q, self.scale, self.min, self.group = q, scale, minimum, group
        self.kernel = _use_kernel(q, self.k)
        self._dense = None

    def matmul(self, x):
        if self.kernel:
            return kernels.linear(x, kernels.Q4, self.n, self.k, self.q, s16=self.scale.view(torch.int16),
                                  m16=self.min.view(torch.int16), group=self.group)
        if self._dense is None:
            self._dense = self.dequantized().to(torch.bfloat16)
        return F.linear(x.to(torch.bfloat16), self._dense).float()

    def codes(self) -> torch.Tensor:
        """The 4-bit codes as uint8 [N, K]."""
        g, half = self.group, self.group // 2
        b = self.q.view(self.n, self.k // g, half)
        return torch.cat([b & 15, b >> 4], dim=-1).view(self.n, self.k)

    def dequantized(self):
        g = self.group
        codes = self.codes().view(self.n, self.k // g, g).float()
        return (codes * self.scale.float()[..., None] + self.min.float()[..., None]).view(self.n, self.k)

    def nbytes(self):
        return self.q.numel() + (self.scale.numel() + self.min.numel()) * 2


def quantize_int8(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict]:
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return {"q": q, "scale": scale.float()}, {}


def quantize_int4(w: torch.Tensor, group: int) -> tuple[dict[str, torch.Tensor], dict]:
    n, k = w.shape
    if group not in GROUP_SIZES:
        raise CadenceError(f"int4 group size {group} is not supported; use 32 or 64")
    if k % group:
        raise CadenceError(f"int4 with groups of {group} needs the input width ({k}) to be a multiple of {group}; try --group-size 32")
    wg = w.view(n, k // group, group)
    lo, hi = wg.amin(-1), wg.amax(-1)
    # fp16 scale and minimum, rounded first so that the codes fit the values the kernel will use
    scale = ((hi - lo) / 15.0).clamp(min=1e-8).half()
    minimum = lo.half()
    q = torch.round((wg - minimum.float()[..., None]) / scale.float()[..., None]).clamp(0, 15).to(torch.uint8)
    half = group // 2
    packed = (q[..., :half] | (q[..., half:] << 4)).reshape(n, k // 2).contiguous()
    return {"q": packed, "scale": scale, "min": minimum}, {"group": group}


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
    else:
        arrays, meta = quantize_int4(w, group_size)
    meta["error"] = round(_relative_error(w, decode(fmt, arrays, meta)), 6)
    return arrays, meta


def decode(fmt: str, arrays: dict[str, torch.Tensor], meta: dict, bias: torch.Tensor | None = None) -> Linear:
    check_format(fmt)
    if fmt in FLOAT_DTYPES:
        return DenseLinear(arrays["w"], bias)
    if fmt == "int8":
        return Int8Linear(arrays["q"], arrays["scale"], bias)
    return Int4Linear(arrays["q"], arrays["scale"], arrays["min"], int(meta["group"]), bias)


FORMATS = (*FLOAT_DTYPES, "int8", "int4")


def check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise CadenceError(f"weight format '{fmt}' is not known; use one of {', '.join(FORMATS)}")
    return fmt


def float_dtype(fmt: str) -> torch.dtype:
    """The dtype a format keeps its embedding in (quantized formats: bf16)."""
    return FLOAT_DTYPES.get(fmt, torch.bfloat16)
