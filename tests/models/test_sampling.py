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
