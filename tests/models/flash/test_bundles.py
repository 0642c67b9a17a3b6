"""flash/bundles.py and reader.py: a tiny int4 store's FFN bundles, written from its real GGUF, read back
through real direct reads of the real file; the dense store untouched; damaged input in one sentence."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import tempfile

import numpy as np
import pytest
import torch

from common.errors import CadenceError
from models import linear
from formats.convert import convert
from flash import bundles
from models import flash_records as records
from flash.costmodel import ReadCurve
from flash.reader import BundleReader
from formats.source import GGUFSource
from formats.store import WeightStore
from models.transformer import Transformer
from formats.weights import ResidentWeights, layer_from_views, random_tensors
from shm.dio import MEMORY_FS, cached_bytes, evict_page_cache, fs_type
from tests.conftest import TINY
from tests.models.tiny_files import write_gguf

K = 1024
# measured on this machine's disk (4 KiB reads 0.33 GB/s, 64 KiB 2.2 GB/s with 32 in flight): merges through gaps
CURVE = ReadCurve((4 * K, 16 * K, 64 * K, 1024 * K), (0.33, 0.83, 2.2, 2.0))
# 640 neurons: a few dozen 4 KiB blocks a layer; llama's dim 96 gives 176-byte records, which straddle blocks
SHAPES = {n: dataclasses.replace(TINY[n], ffn_dim=640) for n in ("qwen", "llama")}


def _store(tmp_path, name: str, fmt: str = "int4") -> tuple[WeightStore, GGUFSource, dict]:
    args = SHAPES[name]
    t = random_tensors(args, seed=7)
    src = GGUFSource(write_gguf(tmp_path / f"{name}.gguf", args, t))
    return WeightStore(convert(src, tmp_path / f"store-{name}-{fmt}", fmt)), src, t


def _expected(store: WeightStore, src: GGUFSource, i: int) -> list[dict[str, torch.Tensor]]:
    """Layer i's gate and up rows as the dense store holds them, its down columns quantized from the source."""
    buf = store.read_all()
    w = layer_from_views(store, i, store.views(f"layer.{i}", buf[store.groups[f"layer.{i}"].offset :]))
    F = store.args.ffn_dim
    down, _ = linear.quantize_int4(torch.from_numpy(src.get(f"blk.{i}.ffn_down")).T.contiguous(), 32)
    return [w.gate_up.rows(0, F).per_row(), w.gate_up.rows(F, 2 * F).per_row(), down]


def _assert_rows(got: torch.Tensor, want: list[dict[str, torch.Tensor]], neurons: np.ndarray, dim: int) -> None:
    idx = torch.from_numpy(neurons.astype(np.int64))
    for g, w in zip(records.unpack(got, dim), want):
        for key in ("q", "sc", "mn", "s", "m"):
            assert torch.equal(g[key], w[key][idx]), key


@pytest.mark.parametrize("chunk", [1, 7, 40])
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_every_neurons_record_reads_back_its_rows_through_direct_reads(tmp_path, name, chunk):
    store, src, _ = _store(tmp_path, name)
    lay = bundles.write(store, chunk, source=src)
    a = store.args
    assert lay.record == records.record_bytes(a.dim) and (store.dir / bundles.FILE).stat().st_size == lay.file_bytes
    rng = np.random.default_rng(chunk)
    with BundleReader(WeightStore(store.dir), curve=CURVE) as r:
        direct = fs_type(store.dir) not in MEMORY_FS
        assert r.direct == direct
        for i in range(a.n_layers):
            want = _expected(store, src, i)
            whole = r.read_layer(i)
            _assert_rows(whole, want, np.arange(a.ffn_dim), a.dim)  # every neuron of the layer
            for share in (0.05, 0.3, 1.0):
                # a random set in random order, with duplicates: each comes back as often as asked, in place
                n = max(1, int(share * a.ffn_dim))
                neurons = rng.integers(0, a.ffn_dim, n)
                evict_page_cache([store.dir / bundles.FILE])
                before = r.stats.bytes, r.stats.reads
                got = r.read(i, neurons)
                assert got.shape == (n, lay.record)
                assert torch.equal(got, whole[torch.from_numpy(neurons)])
                _assert_rows(got, want, neurons, a.dim)
                read, reads = r.stats.bytes - before[0], r.stats.reads - before[1]
                assert read % 4096 == 0 and 0 < reads and read <= lay.layer_bytes
                if direct:
                    assert cached_bytes(store.dir / bundles.FILE) == 0  # the reads went around the page cache
            got, choice = r.load(i, neurons[:3])
            assert torch.equal(got, whole[torch.from_numpy(neurons[:3])]) and choice.bundles
            assert r.read(i, np.zeros(0, np.int64)).shape == (0, lay.record)


def test_a_given_neuron_order_is_kept_and_read_through(tmp_path):
    store, src, _ = _store(tmp_path, "llama")
    a = store.args
    orders = [np.random.default_rng(i).permutation(a.ffn_dim) for i in range(a.n_layers)]
    bundles.write(store, 5, source=src, orders=orders)
    with BundleReader(WeightStore(store.dir), curve=CURVE) as r:
        assert all(np.array_equal(o, g) for o, g in zip(orders, r.orders))
        for i in range(a.n_layers):
            neurons = np.random.default_rng(9).integers(0, a.ffn_dim, 50)
            want = _expected(store, src, i)
            _assert_rows(r.read(i, neurons), want, neurons, a.dim)
            _assert_rows(r.read_layer(i), want, np.arange(a.ffn_dim), a.dim)
            out = torch.zeros(60, r.record, dtype=torch.uint8)
            got, choice = r.load(i, np.arange(a.ffn_dim)[::-1].copy())  # every neuron: the whole layer is cheaper
            assert not choice.bundles and torch.equal(got, r.read_layer(i).flip(0))
            assert torch.equal(r.read(i, neurons, out=out), out[:50])


def test_the_dense_store_and_its_forward_are_untouched_by_bundles(tmp_path):
    store, src, _ = _store(tmp_path, "qwen")
    digest = hashlib.sha256(store.path.read_bytes()).hexdigest()
    manifest = json.loads((store.dir / "manifest.json").read_text())
    ids = torch.randint(0, store.args.vocab_size, (10,), generator=torch.Generator().manual_seed(0))

    def logits() -> torch.Tensor:
        st = WeightStore(store.dir)
        m = Transformer(st.args, ResidentWeights(st))
        return m.forward(ids, torch.arange(10), m.new_cache(12))

    before = logits()
    bundles.write(store, 3)  # the source found from the store's manifest
    assert hashlib.sha256(store.path.read_bytes()).hexdigest() == digest
    after = json.loads((store.dir / "manifest.json").read_text())
    assert after.pop("bundles") and after == manifest
    assert torch.equal(logits(), before)


def test_damaged_bundles_and_stores_that_cannot_have_them_end_in_one_sentence(tmp_path):
    store, src, _ = _store(tmp_path, "qwen")
    with pytest.raises(CadenceError, match="has no FFN bundles; write them with `launch models bundle"):
        BundleReader(store, curve=CURVE)
    with pytest.raises(CadenceError, match="at least one neuron"):
        bundles.write(store, 0, source=src)
    lay = bundles.write(store, 4, source=src)
    path = store.dir / bundles.FILE
    good = json.loads((store.dir / "manifest.json").read_text())

    def damaged(section: dict | None, match: str) -> None:
        m = json.loads(json.dumps(good))
        m["bundles"] = section
        (store.dir / "manifest.json").write_text(json.dumps(m))
        with pytest.raises(CadenceError, match=match):
            BundleReader(WeightStore(store.dir), curve=CURVE)

    section = good["bundles"]
    damaged({**section, "chunk_neurons": 5}, "bundles section of .* is damaged .*offsets.*launch models bundle")
    damaged({**section, "record_bytes": 64}, "is damaged .*records")
    damaged({k: v for k, v in section.items() if k != "dim"}, "is damaged")
    damaged({**section, "ffn_dim": "many"}, "is damaged")
    damaged([1, 2], "is damaged")
    (store.dir / "manifest.json").write_text(json.dumps(good))
    with open(path, "r+b") as f:
        f.truncate(lay.file_bytes - 4096)
    with pytest.raises(CadenceError, match=f"{path} is {lay.file_bytes - 4096} bytes, the manifest says"):
        BundleReader(WeightStore(store.dir), curve=CURVE)
    path.unlink()
    with pytest.raises(CadenceError, match="is missing"):
        BundleReader(WeightStore(store.dir), curve=CURVE)
    bundles.write(store, 4, source=src)
    with open(path, "r+b") as f:  # layer 1's order: no longer a permutation
        f.seek(lay.order_at(1))
        f.write(np.zeros(8, np.int32).tobytes())
    with pytest.raises(CadenceError, match="layer 1's neuron order is not a permutation"):
        BundleReader(WeightStore(store.dir), curve=CURVE)
    int8, _, _ = _store(tmp_path, "qwen", "int8")
    with pytest.raises(CadenceError, match="for int4 weight stores; .* is int8"):
        bundles.write(int8, 4)
    src.path.unlink()  # the source the store came from is gone
    with pytest.raises(CadenceError, match="is gone; pull or convert it again"):
        bundles.write(store, 4)


def test_a_mixture_of_experts_has_no_bundles(tmp_path):
    from tests.models.tiny_moe import ARCHS
    from tests.models.tiny_moe import write_gguf as write_moe

    args = ARCHS["qwen2_moe"]
    src = GGUFSource(write_moe(tmp_path / "moe.gguf", args, random_tensors(args, seed=1)))
    store = WeightStore(convert(src, tmp_path / "store", "int4"))
    with pytest.raises(CadenceError, match="mixture of experts: FFN bundles are for dense FFN models"):
        bundles.write(store, 4, source=src)


def test_a_store_in_memory_is_read_through_the_page_cache(tmp_path):
    """tmpfs refuses O_DIRECT: the reader falls back to buffered reads and says so, with the same records."""
    store, src, _ = _store(tmp_path, "llama")
    bundles.write(store, 7, source=src)
    shm = tempfile.mkdtemp(prefix="flash-test-", dir="/dev/shm")
    try:
        copy = shutil.copytree(store.dir, f"{shm}/store")
        said = []
        with (
            BundleReader(WeightStore(copy), curve=CURVE, warn=said.append) as r,
            BundleReader(store, curve=CURVE) as disk,
        ):
            assert not r.direct and "direct I/O is impossible on tmpfs" in said[0]
            neurons = np.random.default_rng(1).integers(0, store.args.ffn_dim, 100)
            assert torch.equal(r.read(1, neurons), disk.read(1, neurons))
            assert torch.equal(r.read_layer(0), disk.read_layer(0))
    finally:
        shutil.rmtree(shm)
