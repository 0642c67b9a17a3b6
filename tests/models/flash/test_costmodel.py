"""flash/costmodel.py: the read curve's interpolation, merged reads, the bundles-or-layer choice and
the chunk size a curve favours, on hand-made curves whose answers can be worked out by hand."""

from __future__ import annotations

import json

import numpy as np
import pytest

from common.errors import CadenceError
from flash.costmodel import (
    ReadCurve,
    aligned,
    best_chunk_neurons,
    choose,
    chunk_starts,
    curve_path,
    machine_curve,
    measure_curve,
    plan_reads,
    reads_seconds,
    record_blocks,
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
    assert (
        not many.bundles and many.bytes == layer and many.layer_seconds == pytest.approx(layer / slow.throughput(layer))
    )
    # on FLAT, reading through 36 KiB gaps costs nothing: the same chunks become one read, cheaper than the layer
    merged = choose(list(range(0, 2000, 10)), 4 * K, 8 * 1024 * K, FLAT)
    assert merged.bundles and merged.reads == ((0, 1991),)


def test_the_favoured_chunk_follows_the_curve():
    record = 2672  # one int4 neuron of a 1536-wide model
    # latency-bound curve: reads up to 64 KiB cost alike, so pack neurons and bring neighbours along; a curve
    # where every byte costs the same: one neuron a chunk, one block a neuron (a packed one straddles blocks)
    assert best_chunk_neurons(FLAT, record, 8960, miss=0.05) > 1
    assert best_chunk_neurons(ReadCurve((4 * K, 4096 * K), (1.0, 1.0)), record, 8960, miss=0.05) == 1
    assert aligned(3 * record) == 8 * K
    with pytest.raises(ValueError):
        best_chunk_neurons(FLAT, record, 8960, miss=0.0)


def test_records_map_to_the_blocks_that_cover_them():
    # 3 records of 2672 bytes a chunk (8 KiB): record 1 straddles blocks 0 and 1, record 3 opens chunk 1
    starts = chunk_starts(np.array([0, 1, 2, 3, 5]), 2672, 3)
    assert starts.tolist() == [0, 2672, 5344, 8192, 8192 + 5344]
    assert record_blocks(starts[:2], 2672).tolist() == [0, 1]
    assert record_blocks(starts, 2672).tolist() == [0, 1, 2, 3]  # 8192 + 5344 .. 16207: block 3 alone
    assert record_blocks(np.array([4096 * 7]), 4096).tolist() == [7]  # a record filling one block exactly
    assert record_blocks(np.zeros(0, np.int64), 2672).tolist() == []


def test_the_price_table_agrees_with_read_seconds():
    c = ReadCurve((4 * K, 64 * K, 1024 * K), (0.33, 2.2, 2.0))
    t = c.seconds_table(4 * K, 300)
    assert t[0] == 0.0 and all(t[n] == pytest.approx(c.read_seconds(n * 4 * K)) for n in (1, 2, 3, 16, 17, 256, 300))


def test_the_machine_curve_is_measured_on_first_need_and_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("CADENCE_HOME", str(tmp_path / "home"))
    sample = tmp_path / "sample.bin"
    sample.write_bytes(np.random.default_rng(0).integers(0, 255, 1 << 20, dtype=np.uint8).tobytes())
    said = []
    got = machine_curve(sample, said.append)
    assert said and "measuring this machine's read curve" in said[0] and curve_path().is_file()
    assert got.sizes == tuple(4 * K << i for i in range(9)) and min(got.gbps) > 0  # 4 KiB .. the file's 1 MiB
    assert machine_curve(sample, said.append) == got and len(said) == 1  # kept: not measured again
    sample.with_name("small.bin").write_bytes(b"x" * 100)
    with pytest.raises(CadenceError, match="too small"):
        measure_curve(sample.with_name("small.bin"), tmp_path / "c.json")


def test_a_curve_round_trips_and_a_damaged_or_missing_one_ends_in_one_sentence(tmp_path):
    path = tmp_path / "curve.json"
    FLAT.save(path)
    assert ReadCurve.load(path) == FLAT
    with pytest.raises(CadenceError, match="no read curve at .*launch models read-curve"):
        ReadCurve.load(tmp_path / "none.json")
    path.write_text(json.dumps({"sizes": [4096]}))
    with pytest.raises(CadenceError, match="damaged"):
        ReadCurve.load(path)
    path.write_text("{")
    with pytest.raises(CadenceError, match="damaged"):
        ReadCurve.load(path)
