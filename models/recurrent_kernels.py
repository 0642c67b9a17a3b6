"""The recurrent layers' work in the CPU kernels (csrc/recurrent.cpp), for models/recurrent.py: a convolution over a
tree's taps; the gated delta-net's and Mamba-2's states stepped and read, one pass each; and their elementwise work
before and after the state (each row on its own, one call a layer). Each `*_on` says whether a layer's tensors can go
there (float32 on the CPU, with the kernel library); elsewhere models/recurrent.py runs the same math in torch ops."""

from __future__ import annotations

import torch

from models import kernels, linear
from models.layer_kernel import double_bits


def conv_on(rows: torch.Tensor, weight: torch.Tensor) -> bool:
    cpu = rows.device.type == "cpu" and rows.dtype == weight.dtype == torch.float32 and rows.stride(1) == 1
    return cpu and weight.is_contiguous() and kernels.available()


def gdn_on(state: torch.Tensor, a) -> bool:
    return state.device.type == "cpu" and state.dtype == torch.float32 and a.gdn_v_dim <= 1024 and kernels.available()


def ssm_on(state: torch.Tensor, a) -> bool:
    return state.device.type == "cpu" and state.dtype == torch.float32 and a.ssm_state <= 1024 and kernels.available()


def _threads() -> int:
    return torch.get_num_threads()


def conv_mix(rows: torch.Tensor, base: int, slots: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """models/recurrent.py `conv_mix` (`cad_conv_mix`): torch's products and sums, the same bits."""
    slots = slots.contiguous()
    T, width, kernel = slots.shape[0], weight.shape[0], weight.shape[1]
    out = torch.empty(T, width, dtype=torch.float32)
    args = (rows.data_ptr(), rows.stride(0), base, slots.data_ptr(), T, kernel, weight.data_ptr(), width)
    kernels.lib().cad_conv_mix(*args, out.data_ptr(), _threads())
    return out


def gdn_step(states: torch.Tensor, rows: torch.Tensor, dims: tuple, offsets: tuple, out=None) -> torch.Tensor:
    """n delta-net states [n, Hv, Dk, Dv] (contiguous) a token further from their rows [n, W] (contiguous): a new
    tensor, or `out` (contiguous, not `states`) (`cad_gdn_step`; dims (Hv, Dk, Dv, Hk); offsets of k, v, e^g and beta
    in a row)."""
    out = torch.empty_like(states) if out is None else out
    n, ldr = rows.shape
    kernels.lib().cad_gdn_step(states.data_ptr(), rows.data_ptr(), ldr, n, *dims, *offsets, out.data_ptr(), _threads())
    return out


def gdn_read(states: torch.Tensor, q: torch.Tensor, hk: int) -> torch.Tensor:
    """o [n, Hv, Dv]: each state [n, Hv, Dk, Dv] (contiguous) read by its queries q [n, Hk, Dk] (rows contiguous; head
    h reads q head h / (Hv / Hk))."""
    n, Hv, Dk, Dv = states.shape
    o = torch.empty(n, Hv, Dv, dtype=torch.float32)
    args = (states.data_ptr(), q.data_ptr(), q.stride(0), n, Hv, Dk, Dv, hk, o.data_ptr(), _threads())
    kernels.lib().cad_gdn_read(*args)
    return o


def gdn_scan(state: torch.Tensor, rows: torch.Tensor, q: torch.Tensor, dims: tuple, offsets: tuple, out=None):
    """A chain of T rows [T, W] (rows contiguous) from a delta-net state [Hv, Dk, Dv]: (o [T, Hv, Dv], the last
    state: a new tensor, or `out`), the bits of T `gdn_step`s and `gdn_read`s (`cad_gdn_scan`; q [T, Hk, Dk], rows
    contiguous)."""
    return _scan("cad_gdn_scan", state, rows, q, dims, offsets, (dims[0], dims[2]), out)


def _scan(name: str, state, rows, side, dims: tuple, offsets: tuple, each: tuple, out=None):
    """A scan kernel's call: its outputs [T, *each] and the last state (into `out`, contiguous, where given)."""
    state, T = state.contiguous(), rows.shape[0]
    y, out = torch.empty(T, *each), torch.empty_like(state) if out is None else out
    args = (state.data_ptr(), rows.data_ptr(), rows.stride(0), T, *dims, *offsets, side.data_ptr(), side.stride(0))
    getattr(kernels.lib(), name)(*args, y.data_ptr(), out.data_ptr(), _threads())
    return y, out


def gdn_front(a, w, conv: torch.Tensor, b: torch.Tensor, araw: torch.Tensor, out: torch.Tensor):
    """models/recurrent.py `_front` (`cad_gdn_front`): [k | v | e^g | beta] into `out` (the layer's rows);
    (q [T, Hk, Dk], g [T, Hv]). Each row in one pass, its own bits."""
    T, hk, dk, hv, dv = conv.shape[0], a.gdn_k_heads, a.gdn_k_dim, a.gdn_v_heads, a.gdn_v_dim
    q, g = torch.empty(T, hk, dk), torch.empty(T, hv)
    A, dt = w.gdn_a.float().contiguous(), w.gdn_dt.float().contiguous()
    args = (conv.contiguous().data_ptr(), b.data_ptr(), araw.data_ptr(), b.stride(0), A.data_ptr(), dt.data_ptr())
    args += (T, hk, dk, hv, dv, a.gdn_beta_scale, q.data_ptr(), out.data_ptr(), out.stride(0), g.data_ptr())
    kernels.lib().cad_gdn_front(*args, _threads())
    return q, g


def gdn_back(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The delta-net's gated RMS norm (`cad_gdn_back`): o [T, Hv, Dv] normed head by head, times weight [Dv] (contiguous),
    times SiLU(z) (z [T, Hv * Dv], rows contiguous): [T, Hv * Dv]."""
    T, hv, dv = o.shape
    out = torch.empty(T, hv * dv, dtype=torch.float32)
    args = (o.contiguous().data_ptr(), z.data_ptr(), z.stride(0), weight.data_ptr(), T, hv, dv, eps)
    kernels.lib().cad_gdn_back(*args, out.data_ptr(), _threads())
    return out


def ssm_step(states: torch.Tensor, rows: torch.Tensor, dims: tuple, offsets: tuple, out=None) -> torch.Tensor:
    """n Mamba-2 states [n, H, P, N] (contiguous) a token further from their rows [n, W] (contiguous): a new tensor,
    or `out` (contiguous, not `states`) (`cad_ssm_step`; dims (H, P, N, G); offsets of x, B, dt and exp(dt A) in a
    row)."""
    out = torch.empty_like(states) if out is None else out
    n, ldr = rows.shape
    kernels.lib().cad_ssm_step(states.data_ptr(), rows.data_ptr(), ldr, n, *dims, *offsets, out.data_ptr(), _threads())
    return out


def ssm_read(states: torch.Tensor, c: torch.Tensor, dims: tuple) -> torch.Tensor:
    """y [n, H, P]: each Mamba-2 state [n, H, P, N] (contiguous) read by its C [n, G * N] (rows contiguous)."""
    n, (H, P, N, G) = states.shape[0], dims
    y = torch.empty(n, H, P, dtype=torch.float32)
    args = (states.data_ptr(), c.data_ptr(), c.stride(0), n, H, P, N, G, y.data_ptr(), _threads())
    kernels.lib().cad_ssm_read(*args)
    return y


def ssm_scan(state: torch.Tensor, rows: torch.Tensor, c: torch.Tensor, dims: tuple, offsets: tuple, out=None):
    """A chain of T rows [T, W] (rows contiguous) from a Mamba-2 state [H, P, N]: (y [T, H, P], the last state: a new
    tensor, or `out`), the bits of T `ssm_step`s and `ssm_read`s (`cad_ssm_scan`; c [T, G * N], rows contiguous)."""
    return _scan("cad_ssm_scan", state, rows, c, dims, offsets, (dims[0], dims[1]), out)


def ssm_front(a, w, conv: torch.Tensor, dt_raw: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Mamba-2's rows from its convolution (`cad_ssm_front`): [x | B | dt | exp(dt A)] into `out` (the layer's rows,
    from its convolution's width); C [T, G * N]. Each row in one pass, its own bits."""
    T, H, GN = conv.shape[0], a.ssm_heads, a.ssm_groups * a.ssm_state
    c = torch.empty(T, GN)
    cb = w.ssm_conv_b.float().contiguous() if w.ssm_conv_b is not None else None
    dt, A = w.ssm_dt.float().contiguous(), w.ssm_a.float().contiguous()
    args = (conv.contiguous().data_ptr(), 0 if cb is None else cb.data_ptr(), dt_raw.data_ptr(), dt_raw.stride(0))
    args += (dt.data_ptr(), A.data_ptr(), T, a.ssm_inner, GN, H, out.data_ptr(), out.stride(0), c.data_ptr())
    kernels.lib().cad_ssm_front(*args, _threads())
    return c


SSM_NORMS = {"gated": 0, "none": 1, "before": 2}  # cad_ssm_back's `norm`


def ssm_back(a, w, ys: torch.Tensor, xs: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """Mamba-2's y = ys + D x (ys [T, H, P], x's rows contiguous), normed and gated as `ModelArgs.ssm_norm` says
    (`cad_ssm_back`): [T, H * P]."""
    T, H, P = ys.shape
    out = torch.empty(T, H * P, dtype=torch.float32)
    D = w.ssm_d.float().contiguous()
    weight = w.ssm_norm.float().contiguous() if w.ssm_norm is not None else D  # (unread with no norm)
    args = (ys.contiguous().data_ptr(), xs.data_ptr(), xs.stride(0), D.data_ptr(), z.data_ptr(), z.stride(0))
    args += (weight.data_ptr(), T, H, P, a.ssm_inner // a.ssm_groups, SSM_NORMS[a.ssm_norm], a.norm_eps)
    kernels.lib().cad_ssm_back(*args, out.data_ptr(), _threads())
    return out


def ssm_record(w, a) -> torch.Tensor | None:
    """A Mamba-2 branch as `cad_ssm_layer` reads it (int64), made once per weights object; None where it cannot take
    it: products outside the quantized kernels or with a bias, tensors not fp32 and contiguous."""
    rec = w.ssm_record
    if rec is None:
        rec = w.ssm_record = _ssm_record(w, a)
    return rec if rec.numel() else None


def _ssm_record(w, a) -> torch.Tensor:
    H, P, N, G, inner, width, K = (
        a.ssm_heads,
        a.ssm_head_dim,
        a.ssm_state,
        a.ssm_groups,
        a.ssm_inner,
        a.ssm_conv_dim,
        a.conv_kernel,
    )
    lins = (w.ssm_in, w.ssm_out)
    tensors = (w.ssm_conv, w.ssm_conv_b, w.ssm_dt, w.ssm_a, w.ssm_d, w.ssm_norm)
    plain = all(isinstance(x, linear.QuantLinear) and x.kernel and x.bias is None for x in lins)
    plain = plain and all(t is None or (t.dtype == torch.float32 and t.is_contiguous()) for t in tensors)
    if not plain or (w.ssm_in.n, w.ssm_out.k, tuple(w.ssm_conv.shape)) != (inner + width + H, inner, (width, K)):
        return torch.empty(0, dtype=torch.int64)
    ptr = lambda t: 0 if t is None else t.data_ptr()  # noqa: E731
    head = [H, P, N, G, inner, width, K, SSM_NORMS[a.ssm_norm], *map(ptr, tensors[:5])]
    head += [
        ptr(w.ssm_norm if w.ssm_norm is not None else w.ssm_d),
        double_bits(a.residual_scale),
        double_bits(a.norm_eps),
    ]
    return torch.tensor(head + w.ssm_in.record() + w.ssm_out.record(), dtype=torch.int64)


def ssm_layer(rec: torch.Tensor, x: torch.Tensor, h: torch.Tensor, at, slots: torch.Tensor, end: torch.Tensor) -> None:
    """x [T, dim] += the Mamba-2 branch of h (the layer's normed input; both fp32, contiguous) over a chain of T rows
    from the layer's state (`at`: models/transformer.py `Place`; `slots` int64 [T, K] the rows' taps), the last state
    into `end` (contiguous, not the state): models/recurrent.py `mamba2`'s separate calls in one (`cad_ssm_layer`)."""
    rows, T = at.k, x.shape[0]
    args = (rec.data_ptr(), x.data_ptr(), h.data_ptr(), T, rows.data_ptr(), rows.stride(0), at.base, at.slot0)
    kernels.lib().cad_ssm_layer(*args, slots.data_ptr(), at.v.data_ptr(), end.data_ptr(), _threads())
