"""Ghidorah's splits: dense + sparse attention merged by online softmax, and column-split linears."""

import math

import pytest
import torch

from models.requests import weights_for

from models import kernels, linear
from models import split_attention
from models.attention import Visibility
from models.requests import ForwardPlan, SplitColumns


def _tree(n, g):
    return [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]


@pytest.mark.parametrize("ctx", [0, 5, 31, 32, 100, 300])
@pytest.mark.parametrize("T", [1, 7, 33])
def test_dense_plus_sparse_equals_dense_masked_attention(ctx, T):
    g = torch.Generator().manual_seed(ctx * 100 + T)
    H, Hkv, D = 12, 2, 64
    kc, vc = torch.randn(Hkv, ctx + T, D, generator=g), torch.randn(Hkv, ctx + T, D, generator=g)
    q = torch.randn(T, H, D, generator=g)
    vis = Visibility.tree(ctx, _tree(T, g))
    scale = 1 / math.sqrt(D)
    mask = vis.dense_mask(ctx + T)
    k, v = kc.repeat_interleave(H // Hkv, 0), vc.repeat_interleave(H // Hkv, 0)
    ref = (
        torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1).double(), k.double(), v.double(), attn_mask=mask, scale=scale
        )
        .transpose(0, 1)
        .float()
    )
    fused = kernels.attention(q, kc, vc, vis.n_shared, vis.ptr, vis.idx, scale)
    c_star = vis.n_shared // split_attention.CHUNK
    for c in sorted({0, c_star // 2, c_star}):  # the worker takes the sparse part and the dense chunks from c on
        state = split_attention.attn_dense(q, kc, vc, 0, c, scale)
        ch, nch = split_attention.attn_chunks(
            q, kc, vc, vis.n_shared, vis.ptr, vis.idx, c * split_attention.CHUNK, scale
        )
        merged = split_attention.attn_merge(state, ch, nch)
        assert (merged - ref).abs().max() < 1e-5
        assert torch.equal(merged, fused)  # and bit for bit what one unit computes alone


@pytest.mark.parametrize("fmt", linear.FORMATS)
@pytest.mark.parametrize("ratio", [0.0, 0.25, 0.5, 1.0])
def test_column_split_linear_equals_unsplit(fmt, ratio):
    w = torch.randn(203, 256, generator=torch.Generator().manual_seed(1)) * 0.05
    lin = linear.decode(fmt, *linear.encode(w, fmt))
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(2))
    whole = lin.matmul(x)
    out = torch.full((9, 203), float("nan"))
    cut = int(203 * ratio)
    lin.matmul_cols(x, out, 0, cut)  # one unit's columns ...
    lin.matmul_cols(x, out, cut, 203)  # ... the other's, into the same buffer
    assert torch.equal(out, whole)
    acc = torch.randn(9, 203, generator=torch.Generator().manual_seed(3))
    want = lin.matmul(x, out=acc.clone())
    lin.matmul_cols(x, acc, cut, 203, accumulate=True)  # the residual add, split the same way
    lin.matmul_cols(x, acc, 0, cut, accumulate=True)
    assert torch.equal(acc, want)


@pytest.mark.parametrize("fmt", ["fp32", "int4"])
def test_a_forward_with_every_linear_split_by_columns_equals_the_unsplit_one(tiny_args, fmt):
    """The transformer hands each linear of a multi-token block out; here the two "units" take the
    columns [0, n0) and [n0, N) one after the other (the second first), into the shared buffers."""
    from models.transformer import Transformer
    from formats.weights import TensorWeights, random_tensors

    model = Transformer(tiny_args, TensorWeights(tiny_args, random_tensors(tiny_args, 0), fmt))
    if not model.fused:
        pytest.skip("the column split is on the fused CPU path")
    ids = torch.randint(0, tiny_args.vocab_size, (11,), generator=torch.Generator().manual_seed(1))
    vis = Visibility.tree(0, [-1, 0, 0, 1, 2, 2, 3, 4, 5, 6, 6])
    ref = model.forward(ids, torch.tensor([0, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4]), model.new_cache(16), vis)
    a = tiny_args
    plan = ForwardPlan(
        column_share=0.3,
        bufs=tuple(
            torch.full((16 * n,), float("nan"))
            for n in (a.dim, max(a.dim, a.q_dim, a.ffn_dim), max(a.q_dim + 2 * a.kv_dim, 2 * a.ffn_dim))
        ),
    )
    steps = model.forward_steps(
        ids, torch.tensor([0, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4]), model.new_cache(16), vis, plan=plan
    )
    need, split = next(steps), 0
    try:
        while True:
            if isinstance(need, SplitColumns):
                lin, x, y, acc = need.linear, need.x, need.y, need.accumulate
                n0 = linear.column_split(lin.n, plan.column_share)
                assert 0 < n0 < lin.n
                lin.matmul_cols(x, y, n0, lin.n, acc)  # the worker's columns
                lin.matmul_cols(x, y, 0, n0, acc)  # the verifier's
                need, split = steps.send(None), split + 1
            else:
                need = steps.send(weights_for(model.weights, need))
    except StopIteration as done:
        out = done.value
    assert split == 4 * a.n_layers
    assert torch.equal(out, ref)
