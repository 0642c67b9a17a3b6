"""`launch models pull hf:OWNER/REPO[:FILE]` against a local hub (tests/models/hub_server.py: a real HTTP server
answering huggingface_hub, the real client): a GGUF file pulled and run as a target, an HF directory pulled and
converted, a dropped download continued by the next pull with a Range request, a corrupted file refused with
nothing left behind, and each failure in one sentence."""

from __future__ import annotations

import dataclasses
import json
import socket

import pytest

from formats.weights import random_tensors
from tests.conftest import TINY
from tests.launch.conftest import launch, one_clear_line
from tests.models.hub_server import LocalHub
from tests.models.tiny_files import write_gguf, write_hf_dir

GGUF = "hf:me/tiny:tiny.gguf"


@pytest.fixture
def hub(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # no token file of this machine's user
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with LocalHub() as h:
        monkeypatch.setenv("HF_ENDPOINT", h.url)
        yield h


@pytest.fixture(scope="module")
def tiny_bytes(tmp_path_factory) -> bytes:
    args = dataclasses.replace(TINY["qwen"], n_layers=4)  # a few hundred KB: a download worth dropping midway
    return write_gguf(tmp_path_factory.mktemp("g") / "t.gguf", args, random_tensors(args, seed=3)).read_bytes()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _left(home) -> list[str]:
    """Every file under the home's hub folder (the hash cache aside)."""
    root = home / "models" / "hf"
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) if root.exists() else []


def test_a_pulled_gguf_runs_as_a_target_without_the_network(hub, tiny_bytes, tmp_path, monkeypatch):
    hub.add("me/tiny", {"tiny.gguf": tiny_bytes, "README.md": b"# tiny\n"})
    home = tmp_path / "home"
    p = launch("models", "pull", GGUF, home=home, check=True)
    path = home / "models" / "hf" / "me" / "tiny" / "tiny.gguf"
    assert p.stdout.strip() == f"{GGUF}: {path}" and path.read_bytes() == tiny_bytes
    assert _left(home) == ["me/tiny/.cadence-pull.json", "me/tiny/tiny.gguf"]  # the README was not asked for
    n = len(hub.requests)
    assert launch("models", "pull", GGUF, home=home, check=True).stdout == p.stdout and len(hub.requests) == n

    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")  # pulled: it resolves offline
    out = tmp_path / "rows.json"
    run = launch(
        *("run", "a b c a b c", "--target", GGUF, "--draft", GGUF, "--runtime", "inproc", "--dtype", "int8"),
        *("--max-new-tokens", "4", "--no-monitor", "--no-trace", "--json", str(out)),
        home=home,
        check=True,
    )
    row = json.loads(out.read_text())[0]
    assert row["target"] == GGUF and row["draft"] == GGUF and len(row["new_token_ids"]) == 4, run.stderr
    assert [s.name.split("-int8-")[0] for s in (home / "stores").glob("*-int8-*") if s.is_dir()] == ["tiny"]


def test_an_hf_directory_is_pulled_and_converts(hub, tmp_path):
    args = TINY["llama"]
    src = write_hf_dir(tmp_path / "src", args, random_tensors(args, seed=4))
    files = {f.name: f.read_bytes() for f in src.iterdir()}
    files |= {"generation_config.json": b'{"do_sample": false}', "README.md": b"x", "onnx/model.onnx": b"y"}
    hub.add("me/llama", files)
    home = tmp_path / "home"
    launch("models", "pull", "hf:me/llama", home=home, check=True)
    got = home / "models" / "hf" / "me" / "llama"
    assert sorted(p.name for p in got.iterdir()) == [
        ".cadence-pull.json",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert all((got / n).read_bytes() == files[n] for n in ("config.json", "model.safetensors", "tokenizer.json"))
    p = launch("models", "convert", "hf:me/llama", "--dtype", "int8", home=home, check=True)
    assert p.stdout.startswith(str(home / "stores" / "llama-int8-"))
    listed = launch("models", "list", home=home, check=True).stdout
    assert "hf:me/llama" in listed


def test_a_dropped_download_continues_on_the_next_pull_with_a_range_request(hub, tmp_path):
    # huggingface_hub writes what it received in blocks of 10 MiB (DOWNLOAD_CHUNK_SIZE): a file of 24 MiB
    # dropped after 15 keeps its first 10 (the pull does not run the file: any bytes do)
    data = bytes(range(256)) * (24 << 12)
    hub.add("me/tiny", {"tiny.gguf": data})
    hub.drop[("me/tiny", "tiny.gguf")] = 15 << 20  # then 503 until healed
    home = tmp_path / "home"
    line = one_clear_line(launch("models", "pull", GGUF, home=home))
    assert "answered 503" in line and f"run `launch models pull {GGUF}` again (a download continues where" in line
    partial = [p for p in (home / "models" / "hf" / ".partial").rglob("*.partial")]
    assert len(partial) == 1 and 0 < partial[0].stat().st_size < len(data)
    assert not (home / "models" / "hf" / "me").exists()  # nothing unverified where models are
    have = partial[0].stat().st_size

    hub.heal()
    n = len(hub.requests)
    launch("models", "pull", GGUF, home=home, check=True)
    gets = [(path, rng) for method, path, rng in hub.requests[n:] if method == "GET" and path.startswith("/cdn/")]
    assert gets == [(gets[0][0], f"bytes={have}-")]  # one GET, from the first byte it did not have
    assert (home / "models" / "hf" / "me" / "tiny" / "tiny.gguf").read_bytes() == data
    assert _left(home) == ["me/tiny/.cadence-pull.json", "me/tiny/tiny.gguf"]  # the partial folder is gone


def test_a_corrupted_file_is_refused_and_nothing_is_left(hub, tiny_bytes, tmp_path):
    hub.add("me/tiny", {"tiny.gguf": tiny_bytes})
    hub.corrupt.add(("me/tiny", "tiny.gguf"))
    home = tmp_path / "home"
    line = one_clear_line(launch("models", "pull", GGUF, home=home))
    assert "does not match the hub's sha256" in line and "it was deleted" in line
    assert _left(home) == []
    line = one_clear_line(launch("run", "hi", "--target", GGUF, "--max-new-tokens", "1", home=home))
    assert "does not match the hub's sha256" in line and not list((home / "stores").glob("tiny-*"))


def test_hub_failures_end_in_one_sentence(hub, tiny_bytes, tmp_path, monkeypatch):
    hub.add("me/tiny", {"tiny.gguf": tiny_bytes})
    hub.add("corp/secret", {"s.gguf": tiny_bytes})
    hub.private.add("corp/secret")
    hub.add("corp/gated", {"g.gguf": b"GGUF"})
    hub.gated.add("corp/gated")
    home = tmp_path / "home"
    cases = {
        "hf:me/nope:x.gguf": "the hub has no repository me/nope (404)",
        "hf:me/tiny:other.gguf": "me/tiny on the hub has no file other.gguf (404); its GGUF files: tiny.gguf",
        "hf:corp/secret:s.gguf": "the hub refused access to corp/secret (401)",
        "hf:corp/gated:g.gguf": "corp/gated is gated on the hub: accept its terms on its page and set HF_TOKEN",
        "hf:me/tiny": "me/tiny on the hub is not an HF model directory cadence reads",
        "hf:nope": "'hf:nope' is not a hub model",
        "hf:me/tiny:README.md": "not a .gguf file",
    }
    for name, said in cases.items():
        line = one_clear_line(launch("models", "pull", name, home=home))
        assert said in line, line
    assert "set HF_TOKEN" in one_clear_line(launch("models", "pull", "hf:corp/secret:s.gguf", home=home))
    monkeypatch.setenv("HF_TOKEN", hub.token)
    launch("models", "pull", "hf:corp/secret:s.gguf", home=home, check=True)

    hub.claim[("me/tiny", "tiny.gguf")] = 1 << 60  # listed larger than any disk
    line = one_clear_line(launch("models", "pull", GGUF, home=home))
    assert "not enough free disk under" in line and "point CADENCE_HOME at a disk with room" in line

    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    for cmd in (("models", "pull", GGUF), ("run", "hi", "--target", GGUF)):
        line = one_clear_line(launch(*cmd, home=home))
        assert "cannot reach the Hugging Face hub at http://127.0.0.1:" in line and "(no connection)" in line
    assert _left(home) == ["corp/secret/.cadence-pull.json", "corp/secret/s.gguf"]
