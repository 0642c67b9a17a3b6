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
    steps = [(x[:, i:i + b].abs().amax(-1, keepdim=True) / 254.0).expand(-1, min(b, x.shape[1] - i))
             for i in range(0, x.shape[1], b)]
    return torch.cat(steps, dim=1) @ w.abs().T


@pytest.mark.parametrize("fmt", linear.FORMATS)
@pytest.mark.parametrize("n,k", [(7, 64), (130, 96), (256, 576), (37, 1536), (5, 896)])
def test_matches_float_math_of_the_stored_weights(fmt, n, k):
    """Dense formats: fp32 rounding only. int8/int4: plus the int8 rounding of activations per block of 32."""
    w = _weight(n, k)
    lin = linear.decode(fmt, *linear.encode(w, fmt, group_size=32))
    deq = lin.dequantized()
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(1))
    ref = (x.double() @ deq.double().T).float()
    bound = 1e-5 * (x.abs() @ deq.abs().T)
    if fmt in ("int8", "int4"):
        bound = bound + _activation_bound(x, deq)
    for m in WIDTHS:
        y = lin(x[:m])
        assert y.shape == (m, n)
        assert ((y - ref[:m]).abs() <= bound[:m]).all(), fmt


@pytest.mark.parametrize("fmt,k,group", [(f, 320, 64 if f == "int4" else 32) for f in linear.FORMATS]
                         + [("int4", 352, 32), ("int4", 96, 32)])
def test_rows_are_batch_invariant(fmt, k, group):
    """k = 352 and 96 leave a super-block with an odd number of int4 groups (one group unpaired)."""
    w = _weight(203, k, seed=2)
    lin = linear.decode(fmt, *linear.encode(w, fmt, group_size=group))
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(3))
    full = lin(x)
    for m in WIDTHS:
        assert torch.equal(lin(x[:m]), full[:m])
    for i in (0, 17, 63):
        assert torch.equal(lin(x[i:i + 1])[0], full[i])


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
    assert codes.max() <= 15 and codes.dtype == torch.uint8
    assert lin.nbytes() == 8 * 32 + 2 * 8 * 2 + 2 * 8 * 1 * 2  # codes, 8-bit sc/mn per 32, fp16 S/M per 256


def test_bias_is_added():
    w = _weight(16, 32)
    b = torch.arange(16.0)
    lin = linear.decode("fp32", *linear.encode(w, "fp32"), bias=b)
    x = torch.randn(3, 32)
    assert torch.allclose(lin(x), x @ w.T + b, atol=1e-5)


def test_unknown_format_is_refused():
    from cadence.errors import CadenceError

    with pytest.raises(CadenceError, match="not known"):
        linear.encode(_weight(4, 16), "int3")
