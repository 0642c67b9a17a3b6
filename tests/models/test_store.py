"""Weight store: conversion from real (tiny) GGUF and HF files, layout, round trips, refusal of bad input."""

import os

import pytest
import torch

from common.errors import CadenceError
from models import linear
from formats.convert import convert, ensure_store
from formats.source import GGUFSource, canonical_names
from formats.source_hf import HFSource
from formats.store import ALIGN, WeightStore
from models.transformer import Transformer
from formats.weights import ResidentWeights, TensorWeights, random_tensors
from tests.models.tiny_files import write_gguf, write_hf_dir


@pytest.fixture
def tiny(tiny_args):
    return tiny_args, random_tensors(tiny_args, seed=11)


def test_gguf_source_reads_back_the_hf_layout(tiny, tmp_path):
    args, t = tiny
    src = GGUFSource(write_gguf(tmp_path / "m.gguf", args, t))
    import dataclasses

    assert dataclasses.replace(src.args, norm_eps=args.norm_eps) == args  # GGUF keeps eps as float32
    assert src.args.norm_eps == pytest.approx(args.norm_eps)
    for _, name in canonical_names(args):
        assert torch.equal(torch.from_numpy(src.get(name)), t[name].float()), name  # q/k un-permuted for llama


def test_store_layout_is_aligned_and_in_reading_order(tiny, tmp_path):
    args, t = tiny
    st = WeightStore(convert(GGUFSource(write_gguf(tmp_path / "m.gguf", args, t)), tmp_path / "store", "int4"))
    names = list(st.groups)
    assert names == ["embed"] + [f"layer.{i}" for i in range(args.n_layers)] + st.head_groups() and st.head_groups()
    end = 0
    for g in st.groups.values():
        assert g.offset % ALIGN == 0 and g.nbytes % ALIGN == 0 and g.offset >= end
        end = g.offset + g.nbytes
        for name in g.tensors:
            for a in st.tensors[name]["arrays"].values():
                assert a["offset"] % ALIGN == 0 and g.offset <= a["offset"] < g.offset + g.nbytes
    assert end == st.manifest["file_bytes"] == os.path.getsize(st.path)
    assert all(0 < st.tensors[n]["error"] < 0.2 for n in st.tensors if st.tensors[n]["format"] == "int4")
    assert "head.0" in st.tensors and "out_norm" in st.groups["head.0"].tensors  # a tied model gets a head of its own


def _wide_head(args):
    """The tiny shape with a vocabulary wide enough that the head is written in several parts."""
    import dataclasses

    return dataclasses.replace(args, vocab_size=4000)


@pytest.mark.parametrize("fmt", ["fp32", "int4"])
def test_a_head_in_parts_gives_the_whole_heads_logits_and_argmax_and_a_cut_head_stops_at_the_cut(tiny, tmp_path, fmt):
    from formats.weights import StreamingWeights

    args = _wide_head(tiny[0])
    t = random_tensors(args, seed=3)
    st = WeightStore(convert(GGUFSource(write_gguf(tmp_path / "m.gguf", args, t)), tmp_path / "store", fmt))
    parts = st.head_groups()
    assert len(parts) >= 3
    rows = [st.head_rows(g) for g in parts]
    assert rows[0][0] == 0 and rows[-1][1] == args.vocab_size and all(a[1] == b[0] for a, b in zip(rows, rows[1:]))
    sizes = [st.groups[g].nbytes for g in parts]
    layer = st.groups["layer.0"].nbytes
    assert max(sizes) <= 2 * layer  # a part is about a layer's bytes: it fits the slots a layer does
    ids = torch.randint(0, args.vocab_size, (6,), generator=torch.Generator().manual_seed(0))
    whole = Transformer(args, TensorWeights(args, t, fmt)).forward(
        ids, torch.arange(6), Transformer(args, TensorWeights(args, t, fmt)).new_cache(8)
    )
    ours = Transformer(st.args, ResidentWeights(st))
    assert torch.equal(ours.forward(ids, torch.arange(6), ours.new_cache(8)), whole)  # bit for bit, part by part
    # greedy's argmax part by part: the whole row's, ties to the first (a row of equal logits too)
    assert torch.equal(ours.forward(ids, torch.arange(6), ours.new_cache(8), argmax=True), whole.argmax(-1))
    cut = rows[1][0] + 7  # inside the second part
    draft = Transformer(st.args, StreamingWeights(st, set(st.group_names()) - {"embed"}, head_rows=cut))
    got = draft.forward(ids, torch.arange(6), draft.new_cache(8))
    assert got.shape == (6, cut) and torch.equal(got, whole[:, :cut])  # no -inf columns past the cut


@pytest.mark.parametrize("fmt", linear.FORMATS)
def test_store_model_equals_in_memory_model(tiny, tmp_path, fmt):
    args, t = tiny
    st = WeightStore(convert(GGUFSource(write_gguf(tmp_path / "m.gguf", args, t)), tmp_path / "store", fmt))
    ours = Transformer(st.args, ResidentWeights(st))
    ref = Transformer(args, TensorWeights(args, t, fmt))
    ids = torch.randint(0, args.vocab_size, (12,), generator=torch.Generator().manual_seed(0))
    a = ours.forward(ids, torch.arange(12), ours.new_cache(16))
    b = ref.forward(ids, torch.arange(12), ref.new_cache(16))
    assert torch.equal(a, b)


def test_an_int2_store_holds_its_ffn_in_int2_and_the_rest_in_int4(tiny, tmp_path):
    args, t = tiny
    st = WeightStore(convert(GGUFSource(write_gguf(tmp_path / "m.gguf", args, t)), tmp_path / "store", "int2"))
    fmts = {name: e["format"] for name, e in st.tensors.items()}
    for i in range(args.n_layers):
        assert fmts[f"blk.{i}.ffn_gate_up"] == fmts[f"blk.{i}.ffn_down"] == "int2"
        assert fmts[f"blk.{i}.attn_qkv"] == fmts[f"blk.{i}.attn_out"] == "int4"
    heads = [n for n in fmts if n.startswith("head.")]
    assert heads and all(fmts[n] == "int4" for n in heads) and st.format == "int2"
    int4 = WeightStore(convert(GGUFSource(write_gguf(tmp_path / "m4.gguf", args, t)), tmp_path / "s4", "int4"))
    assert st.path.stat().st_size < int4.path.stat().st_size


def test_quantized_gguf_blocks_are_dequantized(tiny, tmp_path):
    args, t = tiny
    src = GGUFSource(write_gguf(tmp_path / "q.gguf", args, t, qtype="Q8_0"))
    w = torch.from_numpy(src.get("blk.0.ffn_down"))
    ref = t["blk.0.ffn_down"]
    assert not torch.equal(w, ref) and float((w - ref).norm() / ref.norm()) < 0.01


def test_hf_directory_converts_and_matches_transformers(tiny, tmp_path):
    args, t = tiny
    d = write_hf_dir(tmp_path / "hf", args, t)
    st = WeightStore(convert(HFSource(d), tmp_path / "store", "fp32"))
    ours = Transformer(st.args, ResidentWeights(st))
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    ids = torch.randint(0, args.vocab_size, (20,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    got = ours.forward(ids, torch.arange(20), ours.new_cache(24))
    assert (got - ref).abs().max() < 1e-4


def test_conversion_is_keyed_by_source_and_format(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("CADENCE_HOME", str(tmp_path / "home"))
    args, t = tiny
    path = write_gguf(tmp_path / "m.gguf", args, t)
    a = ensure_store(str(path), "bf16")
    b = ensure_store(str(path), "bf16")
    c = ensure_store(str(path), "int8")
    assert a.dir == b.dir != c.dir
    assert a.manifest["source"]["sha256"] == c.manifest["source"]["sha256"]


def _stores(home):
    d = home / "stores"
    return sorted(p.name for p in d.iterdir() if p.is_dir()) if d.exists() else []


@pytest.mark.parametrize("damage", ["magic", "truncate", "header"])
def test_damaged_gguf_is_refused_before_anything_is_written(tiny, tmp_path, monkeypatch, damage):
    home = tmp_path / "home"
    monkeypatch.setenv("CADENCE_HOME", str(home))
    args, t = tiny
    path = write_gguf(tmp_path / "m.gguf", args, t)
    data = bytearray(path.read_bytes())
    if damage == "magic":
        data[:4] = b"XXXX"
    elif damage == "truncate":
        data = data[: len(data) - 5000]
    else:
        data[24:32] = (2**40).to_bytes(8, "little")  # an absurd key count
    path.write_bytes(bytes(data))
    with pytest.raises(CadenceError) as e:
        ensure_store(str(path), "fp32")
    assert str(path) in str(e.value) and "\n" not in str(e.value)
    assert _stores(home) == []


def test_missing_and_unknown_models_are_refused(tmp_path):
    with pytest.raises(CadenceError, match="unknown model 'nonesuch'"):
        ensure_store("nonesuch", "fp32")
    with pytest.raises(CadenceError, match="does not exist"):
        GGUFSource(tmp_path / "absent.gguf")
    with pytest.raises(CadenceError, match="config.json"):
        HFSource(tmp_path)


def _mapping(ptr: int) -> dict[str, int]:
    """The /proc/self/smaps entry of the mapping that holds address `ptr`: its fields in kB."""
    out, inside = {}, False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            if inside:
                break
            inside = lo <= ptr < hi
        elif inside and line.split()[-1] == "kB":
            out[head.rstrip(":")] = int(line.split()[1])
    return out


@pytest.fixture
def huge_or_skip():
    from formats.store import huge_pages

    huge_pages.cache_clear()
    if not huge_pages():
        pytest.skip("this kernel gives no transparent huge pages on request (THP 'never', or not Linux)")
    yield
    huge_pages.cache_clear()


def _resident(t: torch.Tensor) -> int:
    """The bytes of a tensor's whole storage (its mapping) held in memory now (mincore)."""
    import ctypes
    import mmap

    ptr, n, page = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes(), mmap.PAGESIZE
    lo = ptr - ptr % page
    vec = (ctypes.c_ubyte * ((ptr + n - lo + page - 1) // page))()
    mincore = ctypes.CDLL(None, use_errno=True).mincore
    mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    assert mincore(lo, ptr + n - lo, vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec) * page


def test_weights_read_once_sit_on_huge_pages_and_hold_no_more_memory_than_plain_pages(huge_or_skip):
    from formats.store import HUGE_PAGE, weights_buffer

    n = 5 * HUGE_PAGE + 12345
    buf = weights_buffer(n)
    assert _resident(buf) == 0
    buf.fill_(1)
    assert _mapping(buf.data_ptr())["AnonHugePages"] == 5 * HUGE_PAGE // 1024  # its whole pages, asked for before
    assert _resident(buf) <= n + 4096  # and nothing of its mapping past the bytes asked for: no more than plain pages
    assert buf.numel() == n and int(buf.sum()) == n


@pytest.mark.real
def test_a_resident_models_weights_sit_on_huge_pages_and_its_logits_are_the_plain_pages_ones(huge_or_skip, monkeypatch):
    from formats.loading import load_store
    from formats.store import huge_pages
    from models.kvcache import KVCache

    store = ensure_store("qwen2.5-coder-0.5b", "int4")
    huge = load_store(store, tokenizer=False).model
    monkeypatch.setenv("CADENCE_HUGE_PAGES", "0")  # the way back, for a comparison
    huge_pages.cache_clear()
    plain = load_store(store, tokenizer=False).model
    assert _mapping(huge.weights.buffer.data_ptr())["AnonHugePages"] >= 64 * 1024  # the weights' pages: most of them
    if "[madvise]" in open("/sys/kernel/mm/transparent_hugepage/enabled").read():  # ("always": both on huge pages)
        assert _mapping(plain.weights.buffer.data_ptr()).get("AnonHugePages", 0) == 0
    tokens = torch.arange(100, 120)
    logits = [m.forward(tokens, torch.arange(20), KVCache(m.args, 32)) for m in (huge, plain)]
    assert torch.equal(*logits)


def test_a_new_kv_cache_holds_only_the_pages_its_forwards_write_and_reads_as_zeros(tiny_args):
    """A cache in this process is a mapping of its own whose pages the kernel zero-fills as they are first written:
    a new prompt no longer writes zeros over every row of the context, and rows it never reaches hold no memory."""
    from models.kvcache import KVCache

    args, capacity = tiny_args, 8192
    cache = KVCache(args, capacity)
    total = KVCache.numel(args, capacity) * 4
    assert total >= 2 << 20
    assert _resident(cache.k) == 0  # (nothing written yet)
    model = Transformer(args, TensorWeights(args, random_tensors(args, seed=3)))
    model.forward(torch.arange(3, 11), torch.arange(8), cache)
    cache.commit()
    assert _resident(cache.k) < cache.k.numel() * cache.k.element_size() // 2  # 8 of 8192 rows written
    assert int(cache.k[:, :, 8:].count_nonzero()) == 0 and int(cache.k[:, :, :8].count_nonzero()) > 0
    fresh = KVCache(args, 64)  # the same bits as a cache of zeros written: a forward gives the same logits
    zeros = KVCache(args, 64, storage=torch.zeros(KVCache.numel(args, 64)))
    x = torch.arange(5, 12)
    assert torch.equal(model.forward(x, torch.arange(7), fresh), model.forward(x, torch.arange(7), zeros))
