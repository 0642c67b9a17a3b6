"""models/flash/costmodel.py: the read curve's interpolation, merged reads, the bundles-or-layer choice and
the chunk size a curve favours, on hand-made curves whose answers can be worked out by hand."""

from __future__ import annotations

import json

import pytest

from common.errors import CadenceError
from models.flash.costmodel import (
    ReadCurve,
    aligned,
    best_chunk_neurons,
    choose,
    plan_reads,
    reads_seconds,
    runs,
)

K = 1024
# latency-bound below 64 KiB (every read costs 10 us), bandwidth-bound above (6.4 GB/s)
FLAT = ReadCurve((4 * K, 64 * K, 4096 * K), (4 * K / 10e-6 / 1e9, 64 * K / 10e-6 / 1e9, 64 * K / 10e-6 / 1e9))


def test_throughput_interpolates_in_log_size_and_is_flat_beyond_the_ends():
    c = ReadCurve((4 * K, 16 * K), (1.0, 3.0))
    assert c.throughput(4 * K) == pytest.approx(1e9) and c.throughput(16 * K) == pytest.approx(3e9)
    assert c.throughput(8 * K) == pytest.approx(2e9)  # halfway in log size
    assert c.throughput(1) == pytest.approx(1e9) and c.throughput(1 << 30) == pytest.approx(3e9)
    assert c.read_seconds(8 * K) == pytest.approx(8 * K / 2e9) and c.read_seconds(0) == 0.0


def test_stream_seconds_takes_the_best_piece_size_up_to_the_range():
    c = ReadCurve((4 * K, 1024 * K, 4096 * K), (0.5, 2.0, 1.5))
    assert c.stream_seconds(64 * 1024 * K) == pytest.approx(64 * 1024 * K / 2e9)  # 1 MiB pieces beat 4 MiB ones
    assert c.stream_seconds(4 * K) == pytest.approx(4 * K / 0.5e9)


def test_bad_curves_are_refused():
    with pytest.raises(ValueError):
        ReadCurve((8 * K, 4 * K), (1.0, 1.0))
    with pytest.raises(ValueError):
        ReadCurve((4 * K,), (0.0,))


def test_runs_and_merging_through_gaps_that_cost_less_than_a_read():
    assert runs([1, 2, 3, 7, 9, 10]) == [(1, 3), (7, 1), (9, 2)]
    # on FLAT a 4 KiB chunk read costs 10 us, and so does any read up to 64 KiB: gaps are free to read through
    assert plan_reads([0, 2, 5, 40], 4 * K, FLAT) == [(0, 6), (40, 1)]  # 0..5: 24 KiB, one read; 0..40: 164 KiB
    # a curve where size costs linearly and reads nothing extra: never merge
    linear = ReadCurve((4 * K, 4096 * K), (1.0, 1.0))
    assert plan_reads([0, 2, 5], 4 * K, linear) == [(0, 1), (2, 1), (5, 1)]
    assert reads_seconds([(0, 1), (2, 1)], 4 * K, linear) == pytest.approx(2 * 4 * K / 1e9)


def test_choose_prices_bundles_against_the_whole_layer():
    slow = ReadCurve((4 * K, 4096 * K), (4 * K / 10e-6 / 1e9, 1.0))  # 10 us per 4 KiB read, 1 GB/s streamed
    layer = 1024 * K  # streamed at the interpolated 0.80 GB/s: 1.3 ms
    few = choose([3, 500, 1000], 4 * K, layer, slow)
    assert few.bundles and len(few.reads) == 3 and few.bundle_seconds == pytest.approx(30e-6)
    assert few.bytes == 3 * 4 * K
    many = choose(list(range(0, 20000, 100)), 4 * K, layer, slow)  # 200 separate 10 us reads: 2 ms
    assert len(many.reads) == 200 and many.bundle_seconds == pytest.approx(2e-3)
    assert not many.bundles and many.bytes == layer and many.layer_seconds == pytest.approx(layer / slow.throughput(layer))
    # on FLAT, reading through 36 KiB gaps costs nothing: the same chunks become one read, cheaper than the layer
    merged = choose(list(range(0, 2000, 10)), 4 * K, 8 * 1024 * K, FLAT)
    assert merged.bundles and merged.reads == ((0, 1991),)


def test_the_favoured_chunk_follows_the_curve():
    record = 2664  # one int4 neuron of a 1536-wide model
    # latency-bound curve: bigger chunks are nearly free, so group neurons; bandwidth-only curve: one per read
    assert best_chunk_neurons(FLAT, record, miss=0.05) > 1
    assert best_chunk_neurons(ReadCurve((4 * K, 4096 * K), (1.0, 1.0)), 4096, miss=0.05) == 1
    assert aligned(3 * record) == 8 * K
    with pytest.raises(ValueError):
        best_chunk_neurons(FLAT, record, miss=0.0)


def test_a_curve_round_trips_and_a_damaged_or_missing_one_ends_in_one_sentence(tmp_path):
    path = tmp_path / "curve.json"
    FLAT.save(path)
    assert ReadCurve.load(path) == FLAT
    with pytest.raises(CadenceError, match="no read curve at .*bench.disk"):
        ReadCurve.load(tmp_path / "none.json")
    path.write_text(json.dumps({"sizes": [4096]}))
    with pytest.raises(CadenceError, match="damaged"):
        ReadCurve.load(path)
    path.write_text("{")
    with pytest.raises(CadenceError, match="damaged"):
        ReadCurve.load(path)
