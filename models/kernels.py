"""cadence's own CPU kernels (models/csrc), compiled once and loaded with ctypes.

They exist for one property torch's CPU kernels do not promise: a row's result depends only
on that row, never on how many rows are computed with it. With it, a token verified inside a
tree gets exactly the logits it gets when decoded alone.

One build serves every host: the library is compiled once per instruction-set path
(models/kernel_build.py) and the process loads the best path its CPU has (`CADENCE_KERNEL_PATH`
forces one). Every path gives
the quantized formats the same bits (models/csrc/qlinear.hpp). The libraries link OpenMP from the
runtime torch already loaded, so both share one thread pool.
"""

from __future__ import annotations

import contextlib
import ctypes
from functools import lru_cache

import torch

from common.errors import CadenceError
from models.kernel_build import BY_NAME, ENV_PATH, PATHS, build, chosen_path, cpu_flags, cpu_model, host_paths  # noqa: F401

_P = ctypes.c_void_p
_I = ctypes.c_int
_SIGNATURES = {
    "cad_attention": [_P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _P, _P, ctypes.c_float, ctypes.c_float, _I, _I],
    "cad_linear": [_P, _P, _I, _I, _I, _I, _P, _P, _P, _P, _P, _I, _I, _I, _I],
    "cad_experts": [_P, _I, _I, _P, _P, _I, _P, _I, _P, _P, _I, _P, _I, ctypes.c_float, ctypes.c_float, _I],
    "cad_attn_dense": [_P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I, ctypes.c_float, _I, _I],
    "cad_attn_chunks": [_P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _P, _P, _I, _I, ctypes.c_float, _I, _I],
    "cad_attn_merge": [_P, _P, _P, _P, _P, _P, _I, _I, _I, _I],
    "cad_rmsnorm": [_P, _P, _P, _I, _I, ctypes.c_float],
    "cad_qkv_rope": [_P, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I, ctypes.c_float],
    "cad_glu": [_P, _P, _I, _I, _I, _I],
    "cad_oai_glu": [_P, _P, _I, _I, ctypes.c_float, ctypes.c_float],
    "cad_ssm_step": [_P, _P, _I, _I, _I, _I, _I, _I, _I, _I, _I, _I, _P, _I],
    "cad_ssm_read": [_P, _P, _I, _I, _I, _I, _I, _I, _P, _I],
    "cad_conv_mix": [_P, _I, ctypes.c_int64, _P, _I, _I, _P, _I, _P, _I],
    "cad_gdn_step": [_P, _P, _I, _I, _I, _I, _I, _I, _I, _I, _I, _I, _P, _I],
    "cad_gdn_read": [_P, _P, _I, _I, _I, _I, _I, _I, _P, _I],
    "cad_gdn_front": [_P, _P, _P, _I, _P, _P, _I, _I, _I, _I, _I, ctypes.c_float, _P, _P, _I, _P, _I],
    "cad_gdn_back": [_P, _P, _I, _P, _I, _I, _I, ctypes.c_float, _P, _I],
    "cad_ssm_scan": [_P, _P, _I, _I, _I, _I, _I, _I, _I, _I, _I, _I, _P, _I, _P, _P, _I],
    "cad_gdn_scan": [_P, _P, _I, _I, _I, _I, _I, _I, _I, _I, _I, _I, _P, _I, _P, _P, _I],
    "cad_ssm_front": [_P, _P, _P, _I, _P, _P, _I, _I, _I, _I, _P, _I, _P, _I],
    "cad_ssm_back": [_P, _P, _I, _P, _P, _I, _P, _I, _I, _I, _I, _I, ctypes.c_float, _P, _I],
    "cad_ssm_layer": [_P, _P, _P, _I, _P, _I, ctypes.c_int64, _I, _P, _P, _P, _I],
    "cad_flash_ffn": [_P, _I, _I, _P, ctypes.c_long, _P, _I, _P, _I, _I],
    "cad_layer": [_P, _P, _I, _P, _P, _P, _P, _P, _P, _I, _I, _I, _P, _P, ctypes.c_float, ctypes.c_float, _I, _I],
    "cad_layer_many": [_P, _P, _I, _P, _P, _I, _P, ctypes.c_float, ctypes.c_float, _I],
    "cad_head_argmax": [_P, _I, _P, _I, ctypes.c_float, _P, _P, _I],
    "cad_q8_rows": [_P, _P, _I, _I],
    "cad_q8_floats": [_P, _P, _I, _I],
    "cad_fence": [],
    "cad_init": [_I],
}
# weight formats of cad_linear
F32, BF16, F16, Q8, Q4, Q2 = range(6)
TILE = 16  # output rows per tile of the quantized layouts (csrc/qlinear.hpp)


@lru_cache(maxsize=None)
def load(path: str, defines: tuple[str, ...] = (), ask_tiles: bool = True) -> ctypes.CDLL:
    """One path's library, loaded and initialised (the AMX build asks for tile state once per process)."""
    # torch is imported above, so its libgomp is already loaded and ours resolves to it.
    so = ctypes.CDLL(str(build(path, defines)))
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(so, name)
        fn.argtypes = argtypes
        fn.restype = None
    so.cad_kernel_path.restype = ctypes.c_char_p
    so.cad_init(int(ask_tiles))
    return so


_using: list[ctypes.CDLL] = []


@lru_cache(maxsize=1)
def _default() -> ctypes.CDLL:
    return load(chosen_path())


def lib() -> ctypes.CDLL:
    """The library this process runs: the chosen path's (read once), or the one `using` put in place."""
    return _using[-1] if _using else _default()


@contextlib.contextmanager
def using(so: ctypes.CDLL):
    """Run this module's functions on another path's library (tests, benchmarks of one process)."""
    _using.append(so)
    try:
        yield so
    finally:
        _using.pop()


def active_path() -> str:
    """The path the wide passes take in this process ("amx" only where tile state was granted)."""
    return lib().cad_kernel_path().decode()


def available() -> bool:
    try:
        lib()
        return True
    except CadenceError:
        return False


def address(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


KV_KINDS = {torch.float32: 0, torch.float16: 1, torch.uint8: 2}  # the kernels' `kv` argument (csrc/vec.hpp KV_*)


def kv_kind(cache: torch.Tensor) -> int:
    """What a KV cache holds, as the kernels read it: floats, IEEE halves (--kv-dtype f16) or q8_0 rows (q8)."""
    if cache.dtype not in KV_KINDS:
        raise CadenceError(f"a KV cache of {cache.dtype} is not one the kernels read; use --kv-dtype f32, f16 or q8")
    return KV_KINDS[cache.dtype]


def q8_rows(x: torch.Tensor, out: torch.Tensor) -> None:
    """Float rows x [n, d] quantized into q8_0 rows `out` [n, d / 32 * 34] (uint8, rows contiguous)."""
    n, d = x.shape
    assert x.dtype == torch.float32 and x.is_contiguous() and out.dtype == torch.uint8 and out.stride(-1) == 1
    assert out.shape[0] == n and (n <= 1 or out.stride(0) == out.shape[1])
    lib().cad_q8_rows(address(x), address(out), n, d)


def q8_floats(rows: torch.Tensor, d: int) -> torch.Tensor:
    """q8_0 rows [n, d / 32 * 34] (uint8, contiguous) as floats [n, d], exactly as the attention reads them."""
    out = torch.empty(rows.shape[0], d)
    lib().cad_q8_floats(address(rows.contiguous()), address(out), rows.shape[0], d)
    return out


def attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    n_shared: int,
    ptr: torch.Tensor,
    idx: torch.Tensor,
    scale: float,
    want_lse: bool = False,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
):
    """Attention of T query rows over a cache.

    q [T, H, D] fp32; k_cache, v_cache [Hkv, cap, D] fp32 or fp16, or q8_0 rows [Hkv, cap, D / 32 * 34]; row r sees slots [0, n_shared) then
    idx[ptr[r]:ptr[r+1]] (int32, in position order). Returns out [T, H, D] (and lse [T, H]).
    `softcap` > 0: each scaled score s becomes softcap * tanh(s / softcap) (Gemma 2). `sinks` (fp32 [H]): a logit per
    head in each softmax's denominator only (gpt-oss): the output times 1 / (1 + e^(sink - lse)).
    """
    T, H, D = q.shape
    Hkv, cap, _ = k_cache.shape
    assert q.dtype == torch.float32 and q.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert ptr.dtype == torch.int32 and idx.dtype == torch.int32 and ptr.numel() == T + 1
    out = torch.empty_like(q)
    lse = torch.empty(T, H, dtype=torch.float32) if want_lse else None
    assert sinks is None or (sinks.dtype == torch.float32 and sinks.is_contiguous() and sinks.numel() == H)
    tensors = map(address, (q, k_cache, v_cache, out, lse, sinks))
    shape = (T, H, Hkv, D, cap, n_shared, address(ptr), address(idx))
    lib().cad_attention(*tensors, *shape, scale, softcap, kv_kind(k_cache), torch.get_num_threads())
    return (out, lse) if want_lse else out


def linear(
    x: torch.Tensor,
    fmt: int,
    n: int,
    k: int,
    w: torch.Tensor,
    *extra: torch.Tensor,
    row0: int = 0,
    out: torch.Tensor | None = None,
    into: torch.Tensor | None = None,
) -> torch.Tensor:
    """y [M, n] = x [M, k] W^T, fp32 in and out; W in one of the formats above (see csrc/linear.cpp).

    `extra`: int8: (scale,); int4, int2: (sub-scales, sub-minimums, super-scales, super-minimums), in
    tiles of TILE rows; `row0`: the first output row inside the first tile.
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
    a = [address(t) for t in extra] + [None] * (4 - len(extra))
    if m:
        lib().cad_linear(
            address(x), address(y), m, fmt, n, k, address(w), *a, row0, torch.get_num_threads(), int(acc), ldy
        )
    return y


def head_argmax(recs: list, x: torch.Tensor, best: torch.Tensor, ids: torch.Tensor, div: float = 1.0) -> None:
    """Fold parts of the output head (`recs`: each one's `HeadPart.fold_record()`, in token order) into each row's
    running maximum `best` (fp32 [M]) and its token `ids` (int64 [M]), in place, in one call: what folding each part's
    logits x W^T (divided by `div`, Granite's logit scale) with `sampling.HeadArgmax.fold` gives (x: fp32 [M, k], the
    rows' normed input to the head)."""
    assert x.dtype == torch.float32 and x.is_contiguous() and best.is_contiguous() and ids.dtype == torch.int64
    table, threads = torch.tensor(recs, dtype=torch.int64), torch.get_num_threads()
    lib().cad_head_argmax(address(table), len(recs), address(x), x.shape[0], div, address(best), address(ids), threads)


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """`out`: a contiguous [T, dim] tensor to write into (a shared buffer a second unit reads)."""
    x = x.contiguous()
    out = torch.empty_like(x) if out is None else out
    lib().cad_rmsnorm(address(x), address(w), address(out), x.numel() // x.shape[-1], x.shape[-1], eps)
    return out


def qkv_rope(
    qkv: torch.Tensor,
    bias: torch.Tensor | None,
    pos: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    n_heads: int,
    slot0: int,
    l2_eps: float | None = None,
) -> torch.Tensor:
    """Split qkv [T, (H + 2 Hkv) hd], add the bias, rotate q and k; k, v go into the layer's cache at
    slots slot0.. ; returns q [T, H, hd]. `l2_eps`: each rotated query and key head divided by its RMS
    (Llama 4's weightless norm) with that epsilon, before the key is stored."""
    T = qkv.shape[0]
    hkv, cap = k_cache.shape[:2]
    hd = qkv.shape[1] // (n_heads + 2 * hkv)  # (a q8 cache's rows are bytes)
    assert hd <= 1024 and pos.dtype == torch.int64 and qkv.is_contiguous()
    q = torch.empty(T, n_heads, hd, dtype=torch.float32)
    lib().cad_qkv_rope(
        address(qkv),
        address(bias),
        address(pos),
        address(cos),
        address(sin),
        address(q),
        address(k_cache),
        address(v_cache),
        T,
        n_heads,
        hkv,
        hd,
        cap,
        slot0,
        kv_kind(k_cache),
        -1.0 if l2_eps is None else l2_eps,
    )
    return q


GLU_ACTS = {"silu": 0, "gelu_tanh": 1}


def glu(gu: torch.Tensor, act: str = "silu", out: torch.Tensor | None = None) -> torch.Tensor:
    """gu [T, 2F] = [gate | up] -> act(gate) * up [T, F]: SwiGLU (silu) or GeGLU (tanh gelu)."""
    T, f2 = gu.shape
    out = torch.empty(T, f2 // 2, dtype=torch.float32) if out is None else out
    lib().cad_glu(address(gu.contiguous()), address(out), T, f2 // 2, GLU_ACTS[act], torch.get_num_threads())
    return out


def swiglu(gu: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    return glu(gu, "silu", out)


def flash_ffn(
    h: torch.Tensor, matrix: torch.Tensor, slots: torch.Tensor, out: torch.Tensor, accumulate: bool = True
) -> torch.Tensor:
    """out [T, dim] (+)= the FFN of the neurons whose records (models/flash_records.py) are the rows `slots`
    (int32 [n], summed in that order) of `matrix` (uint8 [cap, R]), on h [T, dim] fp32 (csrc/flash.cpp).
    Without the kernel library, the same in torch (equal within float rounding, not bit for bit)."""
    from models import flash_records as records

    T, dim = h.shape
    records.check_dim(dim)
    if dim > 16384 or matrix.dtype != torch.uint8 or matrix.dim() != 2 or matrix.stride(1) != 1:
        raise CadenceError("flash_ffn takes records as a uint8 [rows, bytes] matrix and a model dim up to 16384")
    if matrix.shape[1] < records.record_bytes(dim):
        raise CadenceError(
            f"records of dim {dim} are {records.record_bytes(dim)} bytes; the matrix rows hold {matrix.shape[1]}"
        )
    assert out.shape == (T, dim) and out.dtype == torch.float32 and out.is_contiguous()
    slots = slots.to(torch.int32).contiguous()
    if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= matrix.shape[0]):
        raise CadenceError(f"flash_ffn: a slot lies outside the matrix's {matrix.shape[0]} rows")
    if not available():
        y = records.ffn_reference(h.float(), matrix[slots.long(), : records.record_bytes(dim)], dim)
        return out.add_(y) if accumulate else out.copy_(y)
    h = h.float().contiguous()
    lib().cad_flash_ffn(
        address(h),
        T,
        dim,
        address(matrix),
        matrix.stride(0),
        address(slots),
        slots.numel(),
        address(out),
        int(accumulate),
        torch.get_num_threads(),
    )
    return out
