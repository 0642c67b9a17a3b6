"""The tile layout of the quantized formats: packing round trips, the byte positions the kernels read,
whole tiles as slices (column splits, an output head's first rows) and the store's head rows."""

import pytest
import torch

from models import linear, tiles

G = torch.Generator().manual_seed(0)


def _codes(fmt, n, k):
    if fmt == "int8":
        return torch.randint(-127, 128, (n, k), generator=G, dtype=torch.int8)
    return torch.randint(0, 16 if fmt == "int4" else 4, (n, k), generator=G, dtype=torch.uint8)


@pytest.mark.parametrize("fmt", tiles.QUANTIZED)
@pytest.mark.parametrize("n,k", [(1, 32), (16, 64), (37, 288), (203, 1536)])
def test_codes_round_trip_for_any_rows(fmt, n, k):
    c = _codes(fmt, n, k)
    q = tiles.pack_codes(fmt, c)
    assert q.shape[0] == tiles.count(n) and q.dtype == torch.uint8
    assert torch.equal(tiles.unpack_codes(fmt, q, k, 0, n), c)
    assert torch.equal(
        tiles.unpack_codes(fmt, q[1:], k, 3, min(9, max(0, n - 19))), c[19 : 19 + min(9, max(0, n - 19))]
    )


def test_byte_positions_the_kernels_read():
    """int4: chunk p of group g holds quad p (low nibbles) and quad p + 4 (high) of row j at bytes 4j..4j+3;
    int2: chunk h, bits 2i..2i+1, quad 4h + i; int8: quads in k order, code + 128."""
    n, k = 20, 96
    c4, c2, c8 = _codes("int4", n, k), _codes("int2", n, k), _codes("int8", n, k)
    q4, q2, q8 = (tiles.pack_codes(f, c) for f, c in (("int4", c4), ("int2", c2), ("int8", c8)))
    for t, j, g, i, b in [(0, 3, 1, 2, 1), (1, 3, 2, 3, 3), (0, 15, 0, 0, 0)]:
        r, kk = 16 * t + j, 32 * g + 4 * i + b
        assert int(q4[t, 256 * g + 64 * i + 4 * j + b]) == int(c4[r, kk]) | int(c4[r, kk + 16]) << 4
        h, s = i // 4, i % 4  # int2 quads 0..3 of the group: chunk 0
        assert (int(q2[t, 128 * g + 64 * h + 4 * j + b]) >> 2 * s) & 3 == int(c2[r, kk])
        assert int(q8[t, 64 * (kk // 4) + 4 * j + b]) == int(c8[r, kk]) + 128
    assert q4[1].view(-1, 4, 16, 4)[:, :, n - 16 :].eq(0).all()  # rows past n in the last tile: zeros


@pytest.mark.parametrize("fmt", tiles.QUANTIZED)
def test_row_slices_are_views_of_whole_tiles(fmt):
    w = torch.randn(203, 256, generator=G) * 0.05
    lin = linear.decode(fmt, *linear.encode(w, fmt))
    full = lin.dequantized()
    for n0, n1 in [(0, 203), (16, 48), (7, 93), (192, 203), (200, 201)]:
        part = lin.rows(n0, n1)
        assert part.n == n1 - n0 and part.arrays["q"].data_ptr() == lin.arrays["q"][n0 // 16].data_ptr()
        assert torch.equal(part.dequantized(), full[n0:n1])
        assert torch.equal(part.rows(2, part.n).dequantized(), full[n0 + 2 : n1])


def test_column_split_falls_on_tile_boundaries():
    for n in (203, 2048, 8960, 40):
        for share in (0.0, 0.1, 0.25, 0.5, 0.9, 1.0):
            cut = linear.column_split(n, share)
            assert 0 <= cut <= n and (cut % tiles.TILE == 0 or cut == n)
            assert abs((n - cut) - n * share) <= tiles.TILE / 2 + 1


def test_store_reads_the_head_rows_in_whole_tiles(tmp_path):
    """FR-Spec's head of the frequent tokens: the tiles holding rows below the cut are read, the
    linear keeps exactly those rows."""
    from formats.convert import convert
    from formats.source_hf import HFSource
    from formats.store import WeightStore
    from formats.weights import StreamingWeights, random_tensors
    from tests.conftest import TINY
    from tests.models.tiny_files import write_hf_dir

    args = TINY["qwen"]
    store = WeightStore(
        convert(HFSource(write_hf_dir(tmp_path / "hf", args, random_tensors(args, seed=1))), tmp_path / "s", "int4")
    )
    full = StreamingWeights(store, set(store.group_names()) - {"embed"})
    cut = StreamingWeights(store, set(store.group_names()) - {"embed"}, head_rows=37)
    part, whole = cut.head_part(0), full.head_part(0)
    assert part.out.n == 37 and part.out.arrays["q"].shape[0] == 3
    x = torch.randn(2, args.dim, generator=G)
    assert torch.equal(part.out(x), whole.out(x)[:, :37])
    assert store.head_bytes(37) < store.head_bytes()
