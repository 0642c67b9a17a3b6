"""Nothing finished is lost (issue 24): rows are on disk as each prompt finishes, a prompt that cannot
run is reported and skipped while the others run, and a run killed with SIGKILL keeps what it finished.
(Text that is not UTF-8 on stdin: tests/models/test_tokenizer.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from common import paths
from launch.cmd_run import EXIT_SKIPPED
from tests.conftest import shm_segments
from tests.launch.conftest import launch


def _prompts(tmp_path, *texts) -> str:
    path = tmp_path / "p.jsonl"
    path.write_text(
        "".join(json.dumps({"id": f"p{i}", "kind": "complete", "prompt": t}) + "\n" for i, t in enumerate(texts))
    )
    return str(path)


def test_a_prompt_too_long_is_skipped_and_the_others_run(tiny_gguf, tmp_path):
    out = tmp_path / "rows.json"
    prompts = _prompts(tmp_path, "the cat", "the cat " * 600, "in the")
    p = launch(
        "run",
        "--mode",
        "target",
        "--target",
        str(tiny_gguf),
        "--prompts",
        prompts,
        "--max-new-tokens",
        "4",
        "--context",
        "256",
        "--json",
        str(out),
        "--no-monitor",
        home=tmp_path / "home",
    )
    assert p.returncode == EXIT_SKIPPED and "Traceback" not in p.stderr, p.stderr
    assert "prompt p1 skipped: the prompt has" in p.stderr and "context" in p.stderr and " 256" in p.stderr
    rows = json.loads(out.read_text())
    assert [r["id"] for r in rows] == ["p0", "p2"] and all(len(r["new_token_ids"]) == 4 for r in rows)


def test_a_killed_run_keeps_the_rows_it_finished(tiny_gguf, tmp_path):
    out = tmp_path / "rows.json"
    prompts = _prompts(tmp_path, *[f"prompt number {i}" for i in range(40)])
    env = dict(os.environ, CADENCE_HOME=str(tmp_path / "home"), CADENCE_KERNELS_DIR=str(paths.kernels_dir()))
    before = shm_segments()
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "launch.cli",
            "run",
            "--mode",
            "tree",
            "--target",
            str(tiny_gguf),
            "--draft",
            str(tiny_gguf),
            "--prompts",
            prompts,
            "--max-new-tokens",
            "48",
            "--json",
            str(out),
            "--no-monitor",
            "--no-trace",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 300
    while (
        time.monotonic() < deadline
        and p.poll() is None
        and not (out.exists() and len(json.loads(out.read_text())) >= 2)
    ):
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.wait(30)
    rows = json.loads(out.read_text())  # whole, valid JSON: written atomically
    assert 2 <= len(rows) < 40 and all(len(r["new_token_ids"]) == 48 for r in rows), len(rows)
    deadline = time.monotonic() + 15  # the actors follow their parent; the watchdog unlinks what the run made
    while time.monotonic() < deadline and not shm_segments() <= before:
        time.sleep(0.2)
    assert not [s for s in shm_segments() - before if s.startswith(f"cadence-{p.pid}x")]
