"""cadence's own CPU kernels (models/csrc), compiled once per machine and loaded with ctypes.

They exist for one property torch's CPU kernels do not promise: a row's result depends only
on that row, never on how many rows are computed with it. With it, a token verified inside a
tree gets exactly the logits it gets when decoded alone. The library is built with the
machine's compiler (`-march=native`) into $CADENCE_HOME/kernels, keyed by source, flags and
CPU, and links OpenMP from the runtime torch already loaded, so both share one thread pool.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

from common import paths
from common.errors import CadenceError

CSRC = Path(__file__).parent / "csrc"
SOURCES = ("attention.cpp", "linear.cpp", "ops.cpp")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu++17", "-fno-math-errno"]

_P = ctypes.c_void_p
_I = ctypes.c_int
_SIGNATURES = {
    "cad_attention": [_P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _P, _P, ctypes.c_float, _I],
    "cad_linear": [_P, _P, _I, _I, _I, _I, _P, _P, _P, _P, _P, _I, _I, _I],
    "cad_attn_dense": [_P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I, ctypes.c_float, _I],
    "cad_attn_chunks": [_P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _P, _P, _I, _I, ctypes.c_float, _I],
    "cad_attn_merge": [_P, _P, _P, _P, _P, _P, _I, _I, _I, _I],
    "cad_rmsnorm": [_P, _P, _P, _I, _I, ctypes.c_float],
    "cad_qkv_rope": [_P, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I],
    "cad_swiglu": [_P, _P, _I, _I],
    "cad_fence": [],
}
# weight formats of cad_linear
F32, BF16, F16, Q8, Q4, Q2 = range(6)


def _cpu_key() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
        flags = next((ln for ln in info.splitlines() if ln.startswith(("flags", "Features"))), "")
        model = next((ln for ln in info.splitlines() if ln.startswith("model name")), "")
    except OSError:
        flags = model = ""
    return f"{platform.machine()} {model} {flags}"


def _build() -> Path:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise CadenceError("no C++ compiler found to build cadence's CPU kernels: install g++ (Debian: apt-get install g++)")
    h = hashlib.sha256()
    for name in sorted(p.name for p in CSRC.iterdir()):
        h.update(name.encode() + (CSRC / name).read_bytes())
    h.update(" ".join(FLAGS).encode() + _cpu_key().encode() + cxx.encode())
    out = paths.kernels_dir() / f"libcadence-{h.hexdigest()[:16]}.so"
    if out.exists():
        return out
    paths.writable_dir(out.parent)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_out = Path(tmp) / out.name
        cmd = [cxx, *FLAGS, *(str(CSRC / s) for s in SOURCES), "-o", str(tmp_out)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            first = next((ln for ln in proc.stderr.splitlines() if "error" in ln), proc.stderr.strip()[:300])
            raise CadenceError(f"building cadence's CPU kernels failed ({first}); check that g++ supports C++17")
        os.replace(tmp_out, out)
    return out


@lru_cache(maxsize=1)
def lib() -> ctypes.CDLL:
    # torch is imported above, so its libgomp is already loaded and ours resolves to it.
    so = ctypes.CDLL(str(_build()))
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(so, name)
        fn.argtypes = argtypes
        fn.restype = None
    return so


def available() -> bool:
    try:
        lib()
        return True
    except CadenceError:
        return False


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, n_shared: int,
              ptr: torch.Tensor, idx: torch.Tensor, scale: float, want_lse: bool = False):
    """Attention of T query rows over a cache.

    q [T, H, D] fp32; k_cache, v_cache [Hkv, cap, D] fp32; row r sees slots [0, n_shared) then
    idx[ptr[r]:ptr[r+1]] (int32, in position order). Returns out [T, H, D] (and lse [T, H]).
    """
    T, H, D = q.shape
    Hkv, cap, _ = k_cache.shape
    assert q.dtype == torch.float32 and q.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert ptr.dtype == torch.int32 and idx.dtype == torch.int32 and ptr.numel() == T + 1
    out = torch.empty_like(q)
    lse = torch.empty(T, H, dtype=torch.float32) if want_lse else None
    lib().cad_attention(_ptr(q), _ptr(k_cache), _ptr(v_cache), _ptr(out), _ptr(lse), T, H, Hkv, D, cap, n_shared,
                        _ptr(ptr), _ptr(idx), scale, torch.get_num_threads())
    return (out, lse) if want_lse else out


def linear(x: torch.Tensor, fmt: int, n: int, k: int, w: torch.Tensor, *extra: torch.Tensor,
           out: torch.Tensor | None = None, into: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, n] = x [M, k] W^T, fp32 in and out; W in one of the formats above (see csrc/linear.cpp).

    `extra`: int8: (scale,); int4, int2: (sub-scales, sub-minimums, super-scales, super-minimums).
    With `out`, the product is added to it in place (out += x W^T) and `out` is returned.
    With `into` (a column range of a wider [M, N] buffer, e.g. buf[:, n0:n1]), it is written there.
    """
    assert x.dtype == torch.float32 and x.shape[-1] == k and k % 32 == 0
    x = x.contiguous()
    acc = out is not None
    y = out if acc else into if into is not None else torch.empty(*x.shape[:-1], n, dtype=torch.float32)
    ldy = y.stride(0) if y.dim() == 2 else n
    assert y.stride(-1) == 1 and y.shape[-1] == n
    m = x.numel() // k
    a = [_ptr(t) for t in extra] + [None] * (4 - len(extra))
    if m:
        lib().cad_linear(_ptr(x), _ptr(y), m, fmt, n, k, _ptr(w), *a, torch.get_num_threads(), int(acc), ldy)
    return y


CHUNK = 32  # keys per chunk of the canonical attention (csrc/attention.cpp: CH)


def attn_dense(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, c0: int, c1: int, scale: float,
               state: tuple | None = None) -> tuple:
    """Running states (m [T, H], l [T, H], o [T, H, D]) over shared-prefix chunks [c0, c1)."""
    T, H, D = q.shape
    Hkv, cap, _ = k_cache.shape
    if state is None:
        state = (torch.full((T, H), float("-inf")), torch.zeros(T, H), torch.zeros(T, H, D))
    m, l, o = state
    lib().cad_attn_dense(_ptr(q.contiguous()), _ptr(k_cache), _ptr(v_cache), _ptr(m), _ptr(l), _ptr(o), T, H, Hkv, D,
                         cap, c0, c1, scale, torch.get_num_threads())
    return state


def max_chunks(n_shared: int, ptr: torch.Tensor, k0: int) -> int:
    """How many chunk states a row can have from key index k0 on."""
    longest = int((ptr[1:] - ptr[:-1]).max()) if ptr.numel() > 1 else 0
    return max(1, -(-(max(n_shared - k0, 0) + longest) // CHUNK))


def attn_chunks(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, n_shared: int, ptr: torch.Tensor,
                idx: torch.Tensor, k0: int, scale: float, maxc: int | None = None,
                out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's chunk states from key index k0 on: ([T, H, maxc, D + 2], counts [T]); `out`: where to write them."""
    T, H, D = q.shape
    Hkv, cap, _ = k_cache.shape
    maxc = maxc or max_chunks(n_shared, ptr, k0)
    ch = torch.empty(T, H, maxc, D + 2) if out is None else out.view(torch.float32)[:T * H * maxc * (D + 2)].view(T, H, maxc, D + 2)
    nch = torch.zeros(T, dtype=torch.int32)
    lib().cad_attn_chunks(_ptr(q.contiguous()), _ptr(k_cache), _ptr(v_cache), _ptr(ch), _ptr(nch), T, H, Hkv, D, cap,
                          n_shared, _ptr(ptr), _ptr(idx), k0, maxc, scale, torch.get_num_threads())
    return ch, nch


def attn_merge(state: tuple, ch: torch.Tensor, nch: torch.Tensor) -> torch.Tensor:
    """Fold chunk states into the running states in order and normalise: the attention output [T, H, D]."""
    m, l, o = state
    T, H, D = o.shape
    out = torch.empty(T, H, D)
    lib().cad_attn_merge(_ptr(m), _ptr(l), _ptr(o), _ptr(ch.contiguous()), _ptr(nch), _ptr(out), T, H, D, ch.shape[2])
    return out


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """`out`: a contiguous [T, dim] tensor to write into (a shared buffer a second unit reads)."""
    x = x.contiguous()
    out = torch.empty_like(x) if out is None else out
    lib().cad_rmsnorm(_ptr(x), _ptr(w), _ptr(out), x.numel() // x.shape[-1], x.shape[-1], eps)
    return out


def qkv_rope(qkv: torch.Tensor, bias: torch.Tensor | None, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             k_cache: torch.Tensor, v_cache: torch.Tensor, n_heads: int, slot0: int) -> torch.Tensor:
    """Split qkv [T, (H + 2 Hkv) hd], add the bias, rotate q and k; k, v go into the layer's cache at
    slots slot0.. ; returns q [T, H, hd]."""
    T = qkv.shape[0]
    hkv, cap, hd = k_cache.shape
    assert hd <= 1024 and pos.dtype == torch.int64 and qkv.is_contiguous()
    q = torch.empty(T, n_heads, hd, dtype=torch.float32)
    lib().cad_qkv_rope(_ptr(qkv), _ptr(bias), _ptr(pos), _ptr(cos), _ptr(sin), _ptr(q), _ptr(k_cache), _ptr(v_cache),
                       T, n_heads, hkv, hd, cap, slot0)
    return q


def swiglu(gu: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    T, f2 = gu.shape
    out = torch.empty(T, f2 // 2, dtype=torch.float32) if out is None else out
    lib().cad_swiglu(_ptr(gu.contiguous()), _ptr(out), T, f2 // 2)
    return out
