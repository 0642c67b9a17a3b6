"""Linear kernels per format: right against float math, and a row's result independent of its batch."""

import pytest
import torch

from models import linear

WIDTHS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 17, 32, 64]  # every int4 path: one row, 2..8 rows in registers, tiles


def _weight(n, k, seed=0):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


def _activation_bound(x, w):
    """|error| from rounding x to int8 per block (x ~ d q, |x - d q| <= d / 2, d = max|x_b| / 127)."""
    b = linear.ACT_BLOCK
    steps = [
        (x[:, i : i + b].abs().amax(-1, keepdim=True) / 254.0).expand(-1, min(b, x.shape[1] - i))
        for i in range(0, x.shape[1], b)
    ]
    return torch.cat(steps, dim=1) @ w.abs().T


@pytest.mark.parametrize("fmt", linear.FORMATS)
@pytest.mark.parametrize("n,k", [(7, 64), (130, 96), (256, 576), (37, 1536), (5, 896)])
def test_matches_float_math_of_the_stored_weights(fmt, n, k):
    """Dense formats: fp32 rounding only. int8/int4/int2: plus the int8 rounding of activations per block."""
    w = _weight(n, k)
    lin = linear.decode(fmt, *linear.encode(w, fmt, group_size=32))
    deq = lin.dequantized()
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(1))
    ref = (x.double() @ deq.double().T).float()
    bound = 1e-5 * (x.abs() @ deq.abs().T)
    if fmt in ("int8", "int4", "int2"):
        bound = bound + _activation_bound(x, deq)
    for m in WIDTHS:
        y = lin(x[:m])
        assert y.shape == (m, n)
        assert ((y - ref[:m]).abs() <= bound[:m]).all(), fmt


@pytest.mark.parametrize(
    "fmt,k,group", [(f, 320, 64 if f == "int4" else 32) for f in linear.FORMATS] + [("int4", 352, 32), ("int4", 96, 32)]
)
def test_rows_are_batch_invariant(fmt, k, group):
    """k = 352 and 96 leave a super-block with an odd number of int4 groups (one group unpaired)."""
    w = _weight(203, k, seed=2)
    lin = linear.decode(fmt, *linear.encode(w, fmt, group_size=group))
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(3))
    full = lin(x)
    for m in WIDTHS:
        assert torch.equal(lin(x[:m]), full[:m])
    for i in (0, 17, 63):
        assert torch.equal(lin(x[i : i + 1])[0], full[i])


@pytest.mark.parametrize("fmt,bound", [("bf16", 0.005), ("fp16", 0.001), ("int8", 0.01), ("int4", 0.12)])
def test_quantization_error_is_what_the_format_promises(fmt, bound):
    w = _weight(256, 512, seed=4)
    arrays, meta = linear.encode(w, fmt, group_size=32)
    assert 0 < meta["error"] < bound
    lin = linear.decode(fmt, arrays, meta)
    assert float((lin.dequantized() - w).norm() / w.norm()) == pytest.approx(meta["error"], rel=1e-3, abs=1e-6)


def test_int4_groups_of_64_are_finer_than_nothing_and_coarser_than_32():
    w = _weight(64, 512, seed=5)
    e32 = linear.encode(w, "int4", group_size=32)[1]["error"]
    e64 = linear.encode(w, "int4", group_size=64)[1]["error"]
    assert e32 < e64 < 0.2


def test_int4_codes_roundtrip_packing():
    w = _weight(8, 64, seed=6)
    lin = linear.decode("int4", *linear.encode(w, "int4", group_size=32))
    codes = lin.codes()
    assert codes.shape == (8, 64) and codes.max() <= 15 and codes.dtype == torch.uint8
    # one tile of 16 rows (8 of them padding): codes, 8-bit sc/mn per 32, fp16 S/M per 256
    assert lin.nbytes() == 16 * 32 + 16 * 2 + 16 * 2 + 2 * 16 * 1 * 2


def test_bias_is_added():
    w = _weight(16, 32)
    b = torch.arange(16.0)
    lin = linear.decode("fp32", *linear.encode(w, "fp32"), bias=b)
    x = torch.randn(3, 32)
    assert torch.allclose(lin(x), x @ w.T + b, atol=1e-5)


def test_unknown_format_is_refused():
    from common.errors import CadenceError

    with pytest.raises(CadenceError, match="not known"):
        linear.encode(_weight(4, 16), "int3")


# ---------------------------------------------------------------- int2 (experts, and a model's FFN products)


def _int2(n, k, seed=0, group=32):
    return linear.decode("int2", *linear.encode(_weight(n, k, seed), "int2", group_size=group))


def test_int2_is_a_model_format_whose_attention_and_head_stay_int4():
    from formats.convert import linear_format

    assert "int2" in linear.FORMATS
    for name in ("blk.3.ffn_gate_up", "blk.3.ffn_down", "blk.3.exp.5.gate_up", "blk.3.ffn_shexp_down"):
        assert linear_format(name, "int2") == "int2", name
    for name in ("blk.3.attn_qkv", "blk.3.attn_out", "head"):
        assert linear_format(name, "int2") == "int4" and linear_format(name, "int4") == "int4", name
    assert linear_format("blk.3.ffn_router", "int2") == "fp32"


def test_int2_error_is_bounded_and_beats_min_max():
    """Gaussian weights: about 0.30 relative error (int4: about 0.08), where a plain min/max range per
    group of 32 gives about 0.39."""
    w = _weight(256, 512, seed=4)
    arrays, meta = linear.encode(w, "int2", group_size=32)
    assert 0 < meta["error"] < 0.32
    lin = linear.decode("int2", arrays, meta)
    assert float((lin.dequantized() - w).norm() / w.norm()) == pytest.approx(meta["error"], rel=1e-3, abs=1e-6)
    wg = w.view(256, -1, 32)
    lo, hi = wg.amin(-1, keepdim=True).clamp(max=0), wg.amax(-1, keepdim=True)
    s = (hi - lo) / 3
    min_max = float(((torch.round((wg - lo) / s).clamp(0, 3) * s + lo).view_as(w) - w).norm() / w.norm())
    assert meta["error"] < 0.8 * min_max
    e4 = linear.encode(w, "int4", group_size=32)[1]["error"]
    assert e4 < meta["error"]
    assert meta["error"] < linear.encode(w, "int2", group_size=64)[1]["error"] < 0.4


def test_int2_layout():
    lin = _int2(8, 256, seed=6)
    assert lin.arrays["q"].shape == (1, 16 * 64) and lin.arrays["q"].dtype == torch.uint8  # one tile, 2 bits a code
    assert lin.arrays["sc"].shape == lin.arrays["mn"].shape == (1, 16 * 8) and lin.arrays["s"].dtype == torch.float16
    codes = lin.codes()
    assert codes.shape == (8, 256) and codes.max() <= 3 and codes.dtype == torch.uint8
    assert (
        lin.nbytes() == 16 * 64 + 2 * 16 * 8 + 2 * 16 * 1 * 2
    )  # 2.625 bits a weight, the tile's padding rows included


@pytest.mark.parametrize("n,k", [(7, 128), (130, 384), (37, 1536), (5, 896), (64, 2048)])
def test_int2_kernel_matches_float_math_of_the_stored_weights(n, k):
    """The kernel against float math of the dequantized weights: the int8 rounding of activations per
    block of 256 is the only error beyond fp32 rounding."""
    lin = _int2(n, k, seed=7)
    assert lin.kernel
    deq = lin.dequantized()
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(8))
    ref = (x.double() @ deq.double().T).float()
    bound = 1e-5 * (x.abs() @ deq.abs().T) + _activation_bound(x, deq)
    for m in WIDTHS:
        y = lin(x[:m])
        assert y.shape == (m, n)
        assert ((y - ref[:m]).abs() <= bound[:m]).all()
    # against x quantized to int8 per block exactly as the kernel does it: fp32 rounding alone
    b = linear.ACT_BLOCK
    xq = torch.cat([_int8_blocks(x[:, i : i + b]) for i in range(0, k, b)], dim=1)
    ref_q = (xq.double() @ deq.double().T).float()
    assert torch.allclose(lin(x), ref_q, rtol=1e-4, atol=1e-5 * float(ref_q.abs().max()))


def _int8_blocks(x):
    amax = x.abs().amax(-1, keepdim=True)
    q = torch.round(x * torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax)))
    return q * (amax / 127.0)


@pytest.mark.parametrize("k,group", [(384, 32), (640, 64), (128, 32)])
def test_int2_rows_are_batch_invariant(k, group):
    """k = 384 and 640 end in a short super-block (4 groups)."""
    lin = _int2(203, k, seed=9, group=group)
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(10))
    full = lin(x)
    for m in WIDTHS:
        assert torch.equal(lin(x[:m]), full[:m])
    for i in (0, 17, 63):
        assert torch.equal(lin(x[i : i + 1])[0], full[i])
    for i0, i1 in ((5, 13), (9, 26), (40, 64)):
        assert torch.equal(lin(x[i0:i1]), full[i0:i1])


def test_int2_rows_and_column_split():
    lin = _int2(100, 256, seed=11)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(12))
    full = lin(x)
    part = lin.rows(30, 70)
    assert part.fmt == "int2" and (part.n, part.k) == (40, 256)
    assert torch.equal(part.dequantized(), lin.dequantized()[30:70])
    assert torch.equal(part(x), full[:, 30:70])
    out = torch.zeros(5, 100)
    cut = linear.column_split(100, 0.37)
    lin.matmul_cols(x, out, 0, cut)
    lin.matmul_cols(x, out, cut, 100)
    assert torch.equal(out, full)
    lin.matmul_cols(x, out, 10, 50, accumulate=True)
    assert torch.equal(out[:, 10:50], full[:, 10:50] + full[:, 10:50])
    res = torch.ones(5, 100)
    assert torch.equal(lin.matmul(x, out=res), torch.ones(5, 100) + full)


@pytest.mark.parametrize(
    "k,group,match",
    [(96, 64, "multiple of 64"), (80, 32, "multiple of 32"), (256, 16, "group size 16 is not supported")],
)
def test_int2_odd_shapes_are_refused(k, group, match):
    from common.errors import CadenceError

    with pytest.raises(CadenceError, match=match):
        linear.encode(_weight(4, k), "int2", group_size=group)
