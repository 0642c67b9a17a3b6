"""What a user of llama.cpp, ollama or mlx-lm expects of the command line (issue 17): a prompt as an
argument or from stdin, the chat template on by default, `launch chat` across turns, a target with
no matching draft still speculating, SIGTERM keeping finished rows, a wheel that installs and runs,
and a chart of a benchmark that a browser draws."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common import paths
from shm.watchdog import REPO_ROOT
from tests.conftest import shm_segments
from tests.launch.conftest import launch


def _env(home):
    return dict(os.environ, CADENCE_HOME=str(home), CADENCE_KERNELS_DIR=str(paths.kernels_dir()))


def test_a_prompt_as_argument_or_from_stdin_gets_the_chat_template_and_no_stop_text(tiny_gguf, tmp_path):
    out = tmp_path / "a.json"
    launch(
        "run",
        "what is a cat?",
        "--mode",
        "target",
        "--target",
        str(tiny_gguf),
        "--max-new-tokens",
        "6",
        "--no-monitor",
        "--json",
        str(out),
        home=tmp_path / "h",
        check=True,
    )
    row = json.loads(out.read_text())[0]
    assert row["chat"] is True and "<|im_start|>" not in row["text"] and "<|im_end|>" not in row["text"]
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "launch.cli",
            "run",
            "--mode",
            "target",
            "--target",
            str(tiny_gguf),
            "--max-new-tokens",
            "6",
            "--no-monitor",
            "--json",
            str(tmp_path / "b.json"),
        ],
        input="what is a cat?",
        capture_output=True,
        text=True,
        env=_env(tmp_path / "h"),
        timeout=600,
    )
    assert p.returncode == 0, p.stderr
    assert (
        json.loads((tmp_path / "b.json").read_text())[0]["new_token_ids"] == row["new_token_ids"]
    )  # piped: the same prompt
    raw = tmp_path / "c.json"
    launch(
        "run",
        "what is a cat?",
        "--chat",
        "off",
        "--mode",
        "target",
        "--target",
        str(tiny_gguf),
        "--max-new-tokens",
        "6",
        "--no-monitor",
        "--json",
        str(raw),
        home=tmp_path / "h",
        check=True,
    )
    assert json.loads(raw.read_text())[0]["chat"] is False


def test_a_target_without_a_matching_draft_speculates_with_the_trie_and_says_so(tiny_gguf, tmp_path):
    out = tmp_path / "r.json"
    p = launch(
        "run",
        "a b c a b c a b",
        "--target",
        str(tiny_gguf),
        "--max-new-tokens",
        "8",
        "--no-monitor",
        "--json",
        str(out),
        home=tmp_path / "h",
        check=True,
    )
    assert "draft: none" in p.stderr and "n-gram trie" in p.stderr
    row = json.loads(out.read_text())[0]
    assert row["mode"] == "tree" and row["draft"] is None


def test_launch_chat_keeps_the_conversation_and_its_cache(tiny_gguf, tmp_path):
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
            "--max-new-tokens",
            "6",
            "--no-trace",
        ],
        input="hello there\nand again\n/exit\n",
        capture_output=True,
        text=True,
        env=_env(tmp_path / "h"),
        timeout=600,
    )
    assert p.returncode == 0, p.stderr
    turns = [ln for ln in p.stderr.splitlines() if ln.startswith("[") and "prompt tokens from the cache" in ln]
    assert len(turns) == 2, p.stderr
    reused = int(turns[1].split(",")[-1].split(" of ")[0])
    assert reused > 0 and "Traceback" not in p.stderr


def test_sigterm_stops_a_run_like_ctrl_c_and_keeps_the_finished_rows(tiny_gguf, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"id": f"p{i}", "kind": "complete", "prompt": "once upon a time"}) + "\n" for i in range(200)
        )
    )
    out, traces = tmp_path / "rows.json", tmp_path / "traces"
    before = shm_segments()
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "launch.cli",
            "run",
            "--prompts",
            str(prompts),
            "--mode",
            "tree",
            "--target",
            str(tiny_gguf),
            "--draft",
            str(tiny_gguf),
            "--max-new-tokens",
            "40",
            "--no-monitor",
            "--json",
            str(out),
            "--trace-dir",
            str(traces),
        ],
        env=_env(tmp_path / "h"),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert _rows_done(p) == 2, "the run ended before it finished two prompts"
    p.send_signal(signal.SIGTERM)
    p.wait(timeout=30)
    err = p.stderr.read()
    assert p.returncode == 128 + signal.SIGTERM and "stopped by SIGTERM" in err and "Traceback" not in err, err
    rows = json.loads(out.read_text())
    assert 0 < len(rows) < 200 and all(len(r["new_token_ids"]) for r in rows)
    assert glob.glob(str(traces / "*.json"))  # the trace was written
    time.sleep(0.5)
    assert shm_segments() <= before


def _rows_done(p) -> int:
    """Wait until the run has finished a few prompts (their summary lines on stderr)."""
    n = 0
    while n < 2:
        line = p.stderr.readline()
        if not line:
            return n
        n += line.startswith("[") and "tok/s" in line
    return n


def test_a_wheel_installs_into_a_fresh_venv_and_runs(tiny_gguf, tmp_path):
    """The wheel carries the kernels' sources and the viewer; installed with its dependencies taken
    from this environment (no download of torch), it generates from outside the checkout, writing
    its trace under $CADENCE_HOME, not into site-packages."""
    dist = tmp_path / "dist"
    b = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist), REPO_ROOT],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert b.returncode == 0, b.stderr
    wheel = next(dist.glob("cadence-*.whl"))
    import zipfile

    names = zipfile.ZipFile(wheel).namelist()
    assert (
        "models/csrc/linear.cpp" in names
        and "models/csrc/vec.hpp" in names
        and "observe/trace_viewer.html" in names
        and "engine/assets/dev.jsonl" in names
    )
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    import sysconfig

    Path(site, "deps-from-the-test-env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the venv's own cadence, not a checkout's
    i = subprocess.run(
        [str(py), "-m", "pip", "install", "--no-deps", "-q", str(wheel)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert i.returncode == 0, i.stderr
    home, work = tmp_path / "home", tmp_path / "elsewhere"
    work.mkdir()
    env |= {"CADENCE_HOME": str(home)}
    r = subprocess.run(
        [
            str(venv / "bin" / "launch"),
            "run",
            "hello",
            "--mode",
            "target",
            "--target",
            str(tiny_gguf),
            "--max-new-tokens",
            "4",
            "--no-monitor",
        ],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    assert glob.glob(str(home / "traces" / "*.json")) and not (Path(site) / "traces").exists()
    v = subprocess.run([str(venv / "bin" / "launch"), "--version"], capture_output=True, text=True, env=env)
    assert v.stdout.startswith("cadence ")


def test_the_benchmark_chart_is_drawn_by_a_browser(tmp_path):
    from tests.launch.conftest import CHROMIUM, CHROMEDRIVER

    if not (CHROMIUM and CHROMEDRIVER):
        pytest.skip("no Chromium here (.ci/install-browser.sh installs it)")
    from bench.chart import main as chart_main

    rows = []
    for budget, mode, draft, rate in (
        (768 << 20, "stdpl", None, 2.0),
        (768 << 20, "tree", "d", 4.0),
        (1 << 30, "stdpl", None, 2.5),
        (1 << 30, "tree", "d", 5.0),
    ):
        for kind in ("complete", "open"):
            rows.append(
                {
                    "id": kind,
                    "kind": kind,
                    "mode": mode,
                    "draft": draft,
                    "target": "t",
                    "format": "int4",
                    "new_token_ids": [1] * 100,
                    "wall_s": 100 / rate,
                    "memory_budget_bytes": budget,
                }
            )
    src = tmp_path / "rows.json"
    src.write_text(json.dumps(rows))
    assert chart_main([str(src), "-o", str(tmp_path / "chart.html")]) == 0
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for f in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run"):
        opts.add_argument(f)
    driver = webdriver.Chrome(options=opts, service=Service(CHROMEDRIVER))
    try:
        driver.get((tmp_path / "chart.html").as_uri())
        charts = driver.find_elements(By.CSS_SELECTOR, "figure svg")
        assert len(charts) == 2  # one per budget
        bars = driver.find_elements(By.CSS_SELECTOR, "rect.bar")
        assert len(bars) == 2 * 2 * 3  # budgets x runs x (two kinds + all)
        tall = {b.get_attribute("data-run"): b.size["height"] for b in bars if b.get_attribute("data-kind") == "all"}
        assert tall["tree"] > tall["stdpl"] > 0  # drawn to scale
        png = driver.get_screenshot_as_png()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    finally:
        driver.quit()
