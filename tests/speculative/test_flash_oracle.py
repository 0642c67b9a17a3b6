"""The oracle cache of bench/flash_oracle.py (the bound on `--draft flash` refreshed from the verifier): after the
target has run tokens [0, n), a layer's cache holds the C neurons most recently among a token's top k_in, the
larger activation first within a token; a masked FFN is the dense FFN over the cache's neurons."""

import torch

from bench.flash_oracle import Oracle


def _acts(ids: list[list[list[int]]], vals: list[list[list[float]]]):
    return torch.tensor(ids, dtype=torch.int16), torch.tensor(vals, dtype=torch.bfloat16)


def _held(o: Oracle) -> set[int]:
    return set(o.mask[0].nonzero().flatten().tolist())


def test_the_cache_keeps_the_most_recent_neurons_larger_first_within_a_token():
    # one layer, 10 neurons, tokens' top-3 (descending |a|)
    ids, vals = _acts([[[1, 2, 3], [4, 5, 1], [6, 7, 8]]], [[[3.0, 2.0, 1.0], [5.0, 4.0, 0.5], [9.0, 8.0, 7.0]]])
    o = Oracle(1, 10, capacity=4, k_in=3)
    o.start(ids, vals)
    o.refresh(1)
    assert _held(o) == {1, 2, 3}  # never-active neurons stay out
    o.refresh(2)  # token 1 marks 4, 5, 1 again: 1, 4, 5 are newest, then 2 (larger |a| than 3 at token 0)
    assert _held(o) == {1, 2, 4, 5}
    o.refresh(3)
    assert _held(o) == {6, 7, 8, 4}
    small = Oracle(1, 10, capacity=4, k_in=2)  # a smaller k_in: each token's first two only
    small.start(ids, vals)
    small.refresh(3)
    assert _held(small) == {6, 7, 4, 5}


def test_a_masked_ffn_is_the_dense_ffn_over_the_cached_neurons():
    torch.manual_seed(0)
    dim, ffn = 8, 12

    class Lin:
        def __init__(self, w):
            self.w = w

        def matmul(self, x, out=None):
            y = x @ self.w.T
            if out is None:
                return y
            out += y

    gate_up, down = Lin(torch.randn(2 * ffn, dim)), Lin(torch.randn(dim, ffn))
    o = Oracle(1, ffn, capacity=5, k_in=5)
    o.start(*_acts([[[0, 3, 4, 7, 11]]], [[[5.0, 4.0, 3.0, 2.0, 1.0]]]))
    o.refresh(1)
    h, x = torch.randn(2, dim), torch.zeros(2, dim)
    o.ffn(0, gate_up, down)(h, x)
    keep = [0, 3, 4, 7, 11]
    g, u = (h @ gate_up.w.T).split(ffn, dim=-1)
    a = torch.nn.functional.silu(g) * u
    torch.testing.assert_close(x, a[:, keep] @ down.w[:, keep].T)
