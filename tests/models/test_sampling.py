"""Greedy's token found head part by head part (`HeadArgmax`) against `argmax` over the whole row."""

import pytest
import torch

from models.sampling import HeadArgmax


@pytest.mark.parametrize("seed", range(6))
def test_head_argmax_over_parts_is_the_whole_rows_argmax(seed):
    g = torch.Generator().manual_seed(seed)
    rows, vocab = 9, 301
    logits = torch.randint(-3, 4, (rows, vocab), generator=g).float()  # few values: ties within and across parts
    logits[1] = 2.0  # one value everywhere: token 0
    logits[2] = float("-inf")  # nothing: token 0, as argmax says
    logits[3, 150] = float("nan")  # a NaN beats every number
    logits[4, [40, 200]] = float("nan")  # the first NaN
    logits[5, 250] = float("inf")
    cuts = sorted(torch.randperm(vocab - 1, generator=g)[:4].add(1).tolist())
    top = HeadArgmax(rows, "cpu")
    for lo, hi in zip([0, *cuts], [*cuts, vocab]):
        top.fold(logits[:, lo:hi], lo)
    assert torch.equal(top.ids, logits.argmax(-1))


@pytest.mark.parametrize("fmt,div", [("int4", 1.0), ("int8", 1.0), ("int2", 1.0), ("int4", 6.0), ("int8", 3.0)])
def test_resident_parts_folded_in_one_kernel_call_give_the_part_by_part_fold(fmt, div):
    """`HeadArgmax.hold` and `flush` (models/kernels.py `head_argmax`): the same tokens and maxima as folding each
    part's logits (divided by Granite's logit scale where `div`), ties across parts to the first, a row of zeros
    (every logit equal) to token 0, a streamed part between resident ones folded in order."""
    from models import kernels, linear
    from formats.weights import HeadPart

    if not kernels.available():
        pytest.skip("no kernel library here (no C++ compiler)")
    g = torch.Generator().manual_seed(4)
    vocab, k, rows = 700, 64, 6
    w = torch.randn(vocab, k, generator=g)
    w[[90, 410, 555]] = w[7] * 4  # equal rows in three parts: equal logits, the first wins
    head = linear.decode(fmt, *linear.encode(w, fmt, 32))
    cuts = [0, 128, 300, 333, 512, vocab]
    parts = [HeadPart(lo, head.rows(lo, hi)) for lo, hi in zip(cuts, cuts[1:])]
    x = torch.randn(rows, k, generator=g)
    x[1] = w[7]  # leans on the repeated rows
    x[2] = 0.0
    ref = HeadArgmax(rows, "cpu")
    for p in parts:
        ref.fold(p.out(x) / div, p.lo)
    assert ref.ids[1] == 90 and ref.ids[2] == 0
    top = HeadArgmax(rows, "cpu", kernel=True, div=div)
    held = [top.hold(p, j != 2, x) for j, p in enumerate(parts)]  # part 2 streamed
    assert held == [True, True, False, True, True]
    top.fold(parts[2].out(x) / div, parts[2].lo)
    assert torch.equal(top.flush(x), ref.ids) and torch.equal(top.best, ref.best)
