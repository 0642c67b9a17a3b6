"""Every run option reaches the engine from every front door: `launch run`, `chat`, `serve`, `plan` and
`bench` build their flags from the one option table (engine/options.py) and their configuration with
the one function (launch/options.py `run_config`); `cadence.LLM(**options)` takes the same names. The
end-to-end checks: a server started with `--runtime inproc` starts no actor, and options given to
`serve` and `chat` show in what each says it runs (/metrics, the start line)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import psutil
import pytest

from common import paths
from engine.config import RunConfig
from engine.options import DEFAULTS, OPTIONS, argv
from launch.cli import build_parser
from launch.cmd_plan import door_config
from launch.options import run_config

COMMANDS = ("run", "chat", "serve", "plan", "bench")
# every option away from its default in one of these (each set a configuration the engine accepts)
OPTION_SETS = [
    dict(
        target="t.gguf",
        mode="chain",
        memory_budget="1GiB",
        max_new_tokens=33,
        temperature=0.5,
        top_p=0.9,
        seed=7,
        top_k=40,
        min_p=0.05,
        repetition_penalty=1.1,
        presence_penalty=0.2,
        frequency_penalty=0.3,
        repeat_last_n=32,
        grammar='start: "a" | "b"',
        logprobs=2,
        prompt_logprobs=True,
        prompt_cache="/tmp/cadence-prompt-cache",
        prompt_cache_ram="64MiB",
        draft="d.gguf",
        dtype="int8",
        draft_dtype="int4",
        chat="on",
        context=777,
        threads=1,
        parallel=3,
        kv_dtype="f32",
        draft_kv_dtype="q8",
        width=6,
        chain_k=3,
        branch_threshold=0.2,
        tree_growth="pacer",
        alpha=0.05,
        no_trie=True,
        fixed_width=True,
        draft_ahead="2",
        draft_window=16,
        profile="p.json",
        draft_vocab=1000,
        expert_eviction="edgemoe",
        expert_preload="router",
        expert_preload_k=3,
        ffn_density=0.5,
        trace_dir="/tmp/cadence-traces",
        no_trace=True,
    ),
    dict(sparse_worker=True, worker_share=0.25, column_share=0.5),
    dict(runtime="inproc", device="cuda"),
]


def test_the_sets_cover_every_option():
    changed = {k for s in OPTION_SETS for k, v in s.items() if v != DEFAULTS[k]}
    assert changed == {o.name for o in OPTIONS}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("given", OPTION_SETS, ids=["budget", "worker", "inproc"])
def test_every_option_reaches_the_configuration_from_every_command(command, given):
    args = build_parser(command).parse_args([command, *argv(given)])
    cfg = door_config(args) if command == "plan" else run_config(args)  # plan: `--for run`'s configuration
    own = {"bench": {"max_new_tokens": 128}, "serve": {"parallel": 0}}.get(command, {})  # bench: fixed lengths;
    want = {**DEFAULTS, **own, **given}  # serve: as many slots as the memory allows
    assert cfg.options() == want
    assert cfg == RunConfig.from_options(**want)  # what cadence.LLM(**options) builds


def test_the_python_api_takes_the_options_by_name(tiny_gguf):
    import cadence

    with cadence.LLM(
        target=str(tiny_gguf),
        draft=str(tiny_gguf),
        runtime="inproc",
        width=5,
        draft_window=9,
        expert_eviction="edgemoe",
        max_new_tokens=3,
        no_trace=True,
    ) as llm:
        got = llm.config.options()
        assert (got["runtime"], got["width"], got["draft_window"], got["expert_eviction"]) == (
            "inproc",
            5,
            9,
            "edgemoe",
        )
        assert len(llm.generate("hello").token_ids) == 3
    with pytest.raises(cadence.CadenceError, match="unknown option.*widht"):
        cadence.LLM(widht=5)


def _profile(tmp_path) -> str:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"width": 0, "partition": "none", "tree": {"parents": [], "ranks": []}}))
    return str(path)


def _env(home) -> dict:
    return dict(os.environ, CADENCE_HOME=str(home), CADENCE_KERNELS_DIR=str(paths.kernels_dir()))


def test_serve_runs_the_options_it_was_given(tiny_gguf, tmp_path):
    """--runtime inproc: no actor process; --expert-eviction, --draft-vocab and --profile: in /metrics."""
    httpx = pytest.importorskip("httpx")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "launch.cli",
            "serve",
            "--target",
            str(tiny_gguf),
            "--draft",
            str(tiny_gguf),
            "--runtime",
            "inproc",
            "--expert-eviction",
            "edgemoe",
            "--draft-vocab",
            "100",
            "--profile",
            _profile(tmp_path),
            "--port",
            str(port),
            "--no-trace",
        ],
        env=_env(tmp_path / "home"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        base, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 120
        while time.monotonic() < deadline and p.poll() is None:
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        health = httpx.get(f"{base}/health").json()
        assert health["config"]["runtime"] == "inproc"
        names = [c.name() for c in psutil.Process(p.pid).children(recursive=True)]
        assert not [n for n in names if n.startswith("cad-")], names  # no actor, no zygote
        info = next(ln for ln in httpx.get(f"{base}/metrics").text.splitlines() if ln.startswith("cadence_run_info"))
        for label in ('runtime="inproc"', 'expert_eviction="edgemoe"', 'draft_vocab="100"', "profile.json"):
            assert label in info, info
    finally:
        p.terminate()
        p.wait(30)


def test_chat_runs_the_options_it_was_given(tiny_gguf, tmp_path):
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "launch.cli",
            "chat",
            "--target",
            str(tiny_gguf),
            "--draft",
            str(tiny_gguf),
            "--memory-budget",
            "2GiB",
            "--expert-eviction",
            "edgemoe",
            "--draft-vocab",
            "100",
            "--profile",
            _profile(tmp_path),
            "--max-new-tokens",
            "3",
            "--no-trace",
        ],
        input="hello\n/exit\n",
        env=_env(tmp_path / "home"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    line = next(ln for ln in p.stderr.splitlines() if "context" in ln and "tokens" in ln)
    for label in ("expert_eviction=edgemoe", "draft_vocab=100", "profile=", "memory_budget=2GiB"):
        assert label in line, line
