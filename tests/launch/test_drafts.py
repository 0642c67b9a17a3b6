"""Drafts per family (engine/drafts.py): a `--draft` whose vocabulary is not the target's is refused in one
sentence before anything converts; `--draft auto` takes the smallest model on this machine that shares the
target's vocabulary (one pulled from the hub too), else the trie, saying which in one line; `launch models
list` shows which models can draft for each."""

from __future__ import annotations

import dataclasses
import json

import pytest

from formats.weights import random_tensors
from tests.conftest import TINY
from tests.launch.conftest import launch, one_clear_line
from tests.models.hub_server import LocalHub
from tests.models.tiny_files import write_gguf

SMALL, OTHER = "hf:me/small:small.gguf", "hf:me/llama:l.gguf"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("drafts")
    big = dataclasses.replace(TINY["qwen"], n_layers=4)  # the same tokenizer as TINY["qwen"], more parameters
    return {
        "big": write_gguf(d / "big.gguf", big, random_tensors(big, seed=1)),
        "small": write_gguf(d / "small.gguf", TINY["qwen"], random_tensors(TINY["qwen"], seed=2)),
        "llama": write_gguf(d / "l.gguf", TINY["llama"], random_tensors(TINY["llama"], seed=3)),
    }


@pytest.fixture
def home(files, tmp_path, monkeypatch):
    """A home with the small qwen and the llama pulled from a local hub (which is gone by the time they run)."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    home = tmp_path / "home"
    with LocalHub() as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        hub.add("me/small", {"small.gguf": files["small"].read_bytes()})
        hub.add("me/llama", {"l.gguf": files["llama"].read_bytes()})
        launch("models", "pull", SMALL, OTHER, home=home, check=True)
    return home


def _stores(home) -> list[str]:
    return sorted(p.name for p in (home / "stores").glob("*") if (p / "manifest.json").exists())


def test_a_draft_with_another_vocabulary_is_refused_before_anything_converts(files, home):
    big = str(files["big"])
    for draft, sizes in ((OTHER, "283 and 300 tokens"), (str(files["llama"]), "283 and 300 tokens")):
        line = one_clear_line(launch("run", "hi", "--target", big, "--draft", draft, "--no-monitor", home=home))
        assert f"the draft {draft} and the target {big} have different tokenizers ({sizes}" in line, line
        assert "give another --draft, or --draft auto" in line
    assert _stores(home) == []  # neither model was converted


def test_auto_takes_the_smallest_pulled_model_that_shares_the_vocabulary(files, home, tmp_path):
    out = tmp_path / "rows.json"
    p = launch(
        *("run", "a b c a b c", "--target", str(files["big"]), "--runtime", "inproc", "--dtype", "int8"),
        *("--max-new-tokens", "3", "--no-monitor", "--no-trace", "--json", str(out)),
        home=home,
        check=True,
    )
    said = [ln for ln in p.stderr.splitlines() if ln.startswith("draft: ")]
    assert said == [
        f"draft: {SMALL} (the default draft qwen2.5-coder-0.5b does not share {files['big']}'s tokenizer)"
    ], p.stderr
    assert json.loads(out.read_text())[0]["draft"] == SMALL
    assert not list((home / "models").glob("qwen*"))  # the default draft was not fetched to find out

    # the llama has no smaller model of its vocabulary here: the trie alone, said in one line
    p = launch(
        *("run", "a b c", "--target", OTHER, "--runtime", "inproc", "--dtype", "int8", "--max-new-tokens", "2"),
        *("--no-monitor", "--no-trace"),
        home=home,
        check=True,
    )
    assert (
        f"draft: none ({OTHER} shares its tokenizer with no smaller model on this machine): the n-gram trie" in p.stderr
    )
    line = one_clear_line(launch("run", "a", "--target", OTHER, "--mode", "chain", "--no-monitor", home=home))
    assert f"no model on this machine shares {OTHER}'s tokenizer and is smaller; give --draft" in line


def test_models_list_shows_which_models_can_draft_for_each(files, home, monkeypatch):
    with LocalHub() as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        hub.add("me/big", {"big.gguf": files["big"].read_bytes()})
        launch("models", "pull", "hf:me/big:big.gguf", home=home, check=True)
    monkeypatch.setenv("COLUMNS", "400")  # one table row a line
    listed = launch("models", "list", home=home, check=True).stdout
    rows = {
        ln.split("│")[1].strip(): [c.strip() for c in ln.split("│")[2:-1]] for ln in listed.splitlines() if "│" in ln
    }
    big = files["big"].stat().st_size / 1e6
    assert rows["hf:me/big:big.gguf"][:5] == ["yes", "instruct", f"{big:.0f} MB", "300", SMALL]  # it has a template
    assert rows[SMALL][3:5] == ["300", "-"] and rows[OTHER][3:5] == ["283", "-"]
    assert rows["qwen2.5-coder-1.5b"][:5] == ["no", "-", "1117 MB", "-", "-"]  # not pulled: nothing read


@pytest.mark.real
def test_the_default_models_draft_within_their_family():
    from engine import drafts

    assert drafts.pick("qwen2.5-coder-1.5b") == "qwen2.5-coder-0.5b"
    assert drafts.pick("qwen2.5-coder-0.5b") is None and drafts.pick("smollm2-135m") is None
    can = drafts.drafters(drafts.pulled_vocabs())
    assert can["qwen2.5-coder-1.5b"] == ["qwen2.5-coder-0.5b"] and can["smollm2-135m"] == []
