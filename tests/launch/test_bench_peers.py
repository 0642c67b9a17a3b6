"""Benchmarks survive their peers (issue 24): another engine runs in a process of its own, and one that
crashes (llama.cpp's native build on a CPU with AMX dies of a general protection fault) becomes rows
that say so, with the rows before it kept and the next prompts answered at once."""

from __future__ import annotations

import os
import signal

import pytest

from bench.peers import AMX_HINT, Peer, death, has_amx
from common import paths
from engine.prompts import Prompt

pytest.importorskip("transformers")


@pytest.fixture
def hf_peer(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("CADENCE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("CADENCE_KERNELS_DIR", str(paths.kernels_dir()))
    peer = Peer(
        "hf", ["--target", str(tiny_gguf), "--dtype", "int4", "--threads", "1", "--engine", "hf", "--hf-dtype", "fp32"]
    )
    yield peer
    peer.close()


def test_a_peer_that_crashes_becomes_rows_that_say_so(hf_peer):
    assert hf_peer.error is None
    p = Prompt("a", "complete", "")
    row = hf_peer.run(p, "hf", [5, 9, 2, 7], False, 4)
    assert row["mode"] == "hf" and len(row["new_token_ids"]) == 4 and "error" not in row
    os.kill(hf_peer.proc.pid, signal.SIGSEGV)  # what llama.cpp's AMX fault looks like from outside
    crashed = hf_peer.run(p, "hf", [5, 9, 2, 7], False, 4)
    assert crashed["new_token_ids"] == [] and crashed["tokens_per_s"] == 0.0
    assert crashed["error"].startswith("hf crashed (SIGSEGV)") and "Traceback" not in crashed["error"]
    after = hf_peer.run(Prompt("b", "complete", ""), "hf-assisted", [3], False, 4)  # no wait, no second crash
    assert after["error"] == crashed["error"] and after["id"] == "b"


def test_the_llama_cpp_crash_says_how_to_build_it_where_amx_is():
    why = death("llama.cpp", -signal.SIGSEGV, "")
    assert why.startswith("llama.cpp crashed (SIGSEGV)")
    assert (AMX_HINT in why) == has_amx()  # the CMake flags that build it without AMX, where they apply
    assert AMX_HINT not in death("llama.cpp", 1, "out of memory") and "exited with code 1: out of memory" in death(
        "llama.cpp", 1, "out of memory"
    )
