"""A model's vocabulary fingerprint (formats/vocab.py): the same from a GGUF file, the HF directory of the same
tokenizer and a weight store converted from either; different where one id has another token; llama.cpp's
padding left out; cached; and, for the real models, what the registry records before they are pulled."""

from __future__ import annotations

import dataclasses
import json

import pytest

from pulls import registry
from formats.vocab import from_tokens, tokens_of_json, vocab_of
from formats.weights import random_tensors
from tests.conftest import TINY
from tests.models.tiny_files import write_gguf, write_hf_dir


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("CADENCE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_a_gguf_its_hf_directory_and_their_stores_share_one_fingerprint(tmp_path, home):
    from formats.convert import ensure_store

    args = TINY["qwen"]
    t = random_tensors(args, seed=1)
    gguf = vocab_of(write_gguf(tmp_path / "a.gguf", args, t))
    hf = vocab_of(write_hf_dir(tmp_path / "a-hf", args, t))
    assert gguf.same_ids(hf) and (gguf.tokens, gguf.rows) == (hf.tokens, hf.rows) == (300, 300)
    assert gguf.params == hf.params  # counted from the GGUF's header and the safetensors' headers
    store = vocab_of(ensure_store(str(tmp_path / "a.gguf"), "int8").dir)
    assert store.same_ids(gguf)

    deeper = dataclasses.replace(args, n_layers=4)
    big = vocab_of(write_gguf(tmp_path / "big.gguf", deeper, random_tensors(deeper, seed=2)))
    assert gguf.drafts_for(big) and not big.drafts_for(gguf) and not gguf.drafts_for(gguf)
    other = vocab_of(write_gguf(tmp_path / "l.gguf", TINY["llama"], random_tensors(TINY["llama"], seed=3)))
    assert other.tokens == 283 and not other.same_ids(gguf)


def test_one_token_changed_changes_the_fingerprint_and_padding_does_not():
    base = ["a", "b", "<|end|>", "c"]
    assert from_tokens(base, 4, 1).fingerprint != from_tokens(["a", "b", "<|end|>", "d"], 4, 1).fingerprint
    assert from_tokens(base, 4, 1).fingerprint != from_tokens(["b", "a", "<|end|>", "c"], 4, 1).fingerprint
    padded = from_tokens([*base, "[PAD4]", "[PAD5]"], 6, 1)  # llama.cpp pads a GGUF's list to the embedding's rows
    assert padded.fingerprint == from_tokens(base, 4, 1).fingerprint and padded.tokens == 4
    assert not padded.same_ids(from_tokens(base, 4, 1))  # ... whose rows still differ
    assert from_tokens(["a", "[PAD1]", "c"], 3, 1).tokens == 3  # only trailing padding at its own id
    assert from_tokens(["a\nb"], 1, 1).fingerprint != from_tokens(["a", "b"], 1, 1).fingerprint


def test_tokens_of_a_tokenizer_json_put_added_tokens_at_their_ids(tmp_path):
    bpe = {"model": {"type": "BPE", "vocab": {"a": 0, "b": 1}}, "added_tokens": [{"id": 3, "content": "<s>"}]}
    assert tokens_of_json(bpe, tmp_path) == ["a", "b", None, "<s>"]
    unigram = {"model": {"type": "Unigram", "vocab": [["<unk>", 0.0], ["x", -1.5]]}, "added_tokens": []}
    assert tokens_of_json(unigram, tmp_path) == ["<unk>", "x"]


def test_the_fingerprint_is_cached_by_path_size_and_mtime(tmp_path, home):
    path = write_gguf(tmp_path / "a.gguf", TINY["qwen"], random_tensors(TINY["qwen"], seed=1))
    v = vocab_of(path)
    cache = home / "stores" / "vocab-fingerprints.json"
    assert list(json.loads(cache.read_text()).values()) == [dataclasses.asdict(v)]
    assert vocab_of(path) == v and len(json.loads(cache.read_text())) == 1
    path.touch()  # another mtime: read again
    assert vocab_of(path) == v and len(json.loads(cache.read_text())) == 2


@pytest.mark.real
def test_the_registry_records_each_pulled_models_fingerprint():
    from pulls.wheels import is_pulled, model_path

    pulled = [s for s in registry.MODELS.values() if is_pulled(s)]
    assert pulled, "no registry model is pulled here (./setup.sh pulls them)"
    for s in pulled:
        assert vocab_of(model_path(s)).fingerprint == s.vocab, s.name


@pytest.mark.real
@pytest.mark.gemma
def test_gemma_270m_has_the_vocabulary_the_registry_records(gemma_270m):
    v = vocab_of(gemma_270m)
    assert v.fingerprint == registry.spec("gemma-3-270m").vocab and v.tokens == v.rows == 262144
