"""flash/predictor.py and train.py on tiny random int4 stores: the FFN-input tap, the fit's recall
against the model's own per-token top neurons, the file's round trip and its refusals."""

from __future__ import annotations

import dataclasses

import json

import numpy as np
import pytest
import torch

from common.errors import CadenceError
from models import linear
from formats import loading
from formats.convert import convert
from flash.footprint import top_k
from flash.footprint import best_predictor, file_name, predictor_bytes, predictors
from flash.predictor import Int2Predictor, LowRankPredictor, Predictor, activations, gate_up_scores, top_mask
from flash.train import FitConfig, capture, fit
from formats.source import GGUFSource
from formats.weights import random_tensors
from tests.conftest import TINY
from tests.models.tiny_files import write_gguf

ARGS = TINY["qwen"]  # dim 64, ffn 96, 2 layers


def _store(root, seed: int):
    return convert(
        GGUFSource(write_gguf(root / f"m{seed}.gguf", ARGS, random_tensors(ARGS, seed=seed))), root / f"s{seed}", "int4"
    )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return loading.load_store(_store(tmp_path_factory.mktemp("pred"), 5))


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, ARGS.vocab_size, (12,), generator=g).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def fitted(tiny):
    cfgs = {8: FitConfig(rank=8), 64: FitConfig(rank=64), "int2": FitConfig(kind="int2")}
    return {
        r: fit(tiny.model, _prompts(8, 1), _prompts(3, 2), dataclasses.replace(c, density=0.3, tokens=12))
        for r, c in cfgs.items()
    }


class _Recorder:
    """A linear that records its inputs and multiplies as the one it wraps."""

    def __init__(self, inner, seen: list):
        self.inner, self.seen = inner, seen

    def matmul(self, x, out=None):
        self.seen.append(x.clone())
        return self.inner.matmul(x, out=out)

    def __call__(self, x):
        self.seen.append(x.clone())
        return self.inner(x)


@pytest.mark.parametrize("fused", [True, False])
def test_the_tap_hands_out_exactly_what_each_layers_ffn_multiplied_and_changes_nothing(tiny, fused):
    m, w = tiny.model, tiny.model.weights
    ids, pos = torch.tensor(_prompts(1, 3)[0]), torch.arange(12)
    old, m.fused = m.fused, fused and m.fused
    plain = m.forward(ids, pos, m.new_cache(16))
    saved = list(w.layers)
    seen: list[list] = [[] for _ in saved]
    try:
        w.layers = [dataclasses.replace(lw, gate_up=_Recorder(lw.gate_up, s)) for lw, s in zip(saved, seen)]
        m.ffn_inputs = []
        tapped = m.forward(ids, pos, m.new_cache(16))
        taps = m.ffn_inputs
    finally:
        w.layers, m.ffn_inputs, m.fused = saved, None, old
    assert torch.equal(plain, tapped)
    assert [i for i, _ in taps] == list(range(ARGS.n_layers))
    for (i, h), s in zip(taps, seen):
        assert len(s) == 1 and h.shape == (12, ARGS.dim) and torch.equal(h, s[0]), i


def test_capture_records_prompt_and_continuation_tokens_per_layer(tiny):
    hs = capture(tiny.model, _prompts(2, 4), 5)
    assert len(hs) == ARGS.n_layers and all(h.shape == (2 * (12 + 5), ARGS.dim) for h in hs)
    assert tiny.model.ffn_inputs is None


def test_recall_beats_chance_grows_with_rank_and_is_what_top_gives(tiny, fitted):
    low, full, int2 = fitted[8], fitted[64], fitted["int2"]
    assert low.rank == 8 and full.rank == 64 and low.density == 0.3
    assert (low.name, full.name, int2.name) == ("r8", "r64", "int2")
    # chance is 0.3; at full rank the map is the layer's own gate and up (less int4 activation rounding); int2
    # computes that map from 2-bit codes, closer than a rank of an eighth of the inputs
    assert 0.45 < low.recall["mean"] < int2.recall["mean"] < full.recall["mean"] and full.recall["min"] > 0.9
    assert low.recall["heldout_tokens"] == 3 * (12 + 12) and 0 < low.recall["mass_mean"] <= 1
    k, hs = top_k(0.3, ARGS.ffn_dim), capture(tiny.model, _prompts(3, 2), 12)
    for p in (low, int2):
        for i, h in enumerate(hs):
            true = top_mask(activations(tiny.model.weights.layer(i).gate_up, h), k)
            ids = p.top(i, h, k)
            assert ids.dtype == torch.int64 and ids.shape == (h.shape[0], k) and bool((ids.diff(dim=-1) > 0).all())
            got = true.gather(1, ids).float().mean().item()
            assert got == pytest.approx(p.recall["per_layer"][i], abs=1e-5), (p.name, i)


def test_the_int2_predictor_is_the_layers_own_gate_and_up_in_int2(tiny, fitted):
    p = fitted["int2"]
    h = torch.randn(3, ARGS.dim)
    for i in range(ARGS.n_layers):
        gu = tiny.model.weights.layer(i).gate_up
        arrays, meta = linear.encode(gu.dequantized(), "int2")
        assert all(torch.equal(p.stacked[name][i], a) for name, a in arrays.items())
        want = linear.decode("int2", arrays, meta).matmul(h)
        assert torch.equal(p.gate_up(i, h), want) and torch.equal(p.scores(i, h), gate_up_scores(want))


def test_a_saved_predictor_loads_back_with_its_scores_and_figures(tiny, fitted):
    p = fitted[8]
    path = p.save(tiny.store)
    assert path == tiny.store.dir / file_name("r8") and not list(tiny.store.dir.glob("*.tmp"))
    q = Predictor.load(tiny.store, "r8")
    assert Predictor.load(tiny.store).rank in (8, 64)
    h = torch.randn(5, ARGS.dim)
    halved = LowRankPredictor(p.w1t.transpose(1, 2).half(), p.w2t.transpose(1, 2).half(), {})  # the file holds fp16
    for i in range(ARGS.n_layers):
        assert torch.equal(q.scores(i, h), halved.scores(i, h))
    assert torch.allclose(q.scores(0, h), p.scores(0, h), rtol=2e-2, atol=1e-3)
    assert q.recall == p.recall and q.density == p.density and q.nbytes == p.nbytes


def test_the_int2_predictor_loads_back_bit_for_bit_and_predictors_rank_by_recall(tiny, fitted):
    for p in fitted.values():
        p.save(tiny.store)
    q = Predictor.load(tiny.store, "int2")
    assert isinstance(q, Int2Predictor) and q.recall == fitted["int2"].recall
    h = torch.randn(4, ARGS.dim)
    assert all(torch.equal(q.scores(i, h), fitted["int2"].scores(i, h)) for i in range(ARGS.n_layers))
    assert q.nbytes == fitted["int2"].nbytes == predictor_bytes(tiny.store, "int2")
    assert predictor_bytes(tiny.store, "r8") == 2 * ARGS.n_layers * 8 * (ARGS.dim + 2 * ARGS.ffn_dim)
    by_recall = sorted(fitted, key=lambda r: -fitted[r].recall["mean"])
    assert predictors(tiny.store) == [fitted[r].name for r in by_recall] and by_recall[0] == 64
    assert Predictor.load(tiny.store).name == best_predictor(tiny.store) == "r64"


def _refused(store, name: str | None, *words: str):
    with pytest.raises(CadenceError) as e:
        Predictor.load(store, name)
    msg = str(e.value)
    assert "\n" not in msg and "train-predictor" in msg and all(w in msg for w in words), msg


def test_missing_truncated_damaged_and_foreign_files_end_in_one_sentence(tiny, fitted, tmp_path):
    st = tiny.store
    path = fitted[64].save(st)
    good = path.read_bytes()
    try:
        _refused(st, "r32", file_name("r32"), "does not exist")
        path.write_bytes(good[: len(good) // 2])
        _refused(st, "r64", str(path), "damaged or truncated")
        bad = bytearray(good)
        for j in range(len(good) // 2, len(good) // 2 + 64):
            bad[j] ^= 0x5A
        path.write_bytes(bytes(bad))
        _refused(st, "r64", str(path), "damaged")
    finally:
        path.write_bytes(good)
    other = loading.load_store(_store(tmp_path, 6)).store  # the same shape, other weights
    (other.dir / path.name).write_bytes(good)
    _refused(other, "r64", "another model")
    _refused(loading.load_store(_store(tmp_path, 7)).store, None, "has no activation predictor")
    path = fitted["int2"].save(st)
    good = path.read_bytes()
    try:
        arrays = fitted["int2"].arrays()
        np.savez(path, header=np.array(json.dumps(fitted["int2"].header)), **dict(arrays, q=arrays["q"][:, :-1]))
        _refused(st, "int2", str(path), "damaged (arrays")
    finally:
        path.write_bytes(good)


@pytest.mark.parametrize(
    "given,words",
    [
        ({"kind": "int2", "rank": 64}, "has no rank"),
        ({"rank": 0}, "a rank of 1"),
        ({"density": 0.0}, "a density"),
        ({"kind": "pca"}, "one of int2, lowrank"),
    ],
)
def test_a_fit_config_refuses_bad_values_in_one_sentence(given, words):
    with pytest.raises(CadenceError, match=words):
        FitConfig(**given)
