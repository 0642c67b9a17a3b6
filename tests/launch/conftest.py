"""The launch tests' fixtures: the `launch` command in a subprocess, a tiny GGUF model, and a real trace
for the trace tools and the viewer (one fake-actor run, once per session)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from common import paths
from formats.weights import random_tensors
from tests.conftest import TINY
from tests.models.tiny_files import write_gguf

from common.settings import WorkerSplit
from scheduler.runtime import Runtime
from tests.runtime.fake_run import fake_model, fake_plan, prompt, small_config, speculation


@dataclass(frozen=True)
class FakeTrace:
    path: Path
    trace: dict
    tokens: int
    rounds: int  # verifications of a draft tree: one arrow each from the tree to its verification
    pids: dict  # role -> pid


@pytest.fixture(scope="session")
def fake_trace(tmp_path_factory) -> FakeTrace:
    """The scheduler `launch run` uses over the four fakes: streamed, tree mode with the worker, a
    fixed budget and no trie, so that every verification is of a tree the draft built."""
    d = tmp_path_factory.mktemp("traces")
    plan = fake_plan()
    with Runtime(small_config(d, plan)) as s:
        spec = speculation(
            s,
            fake_model(tmp_path_factory.mktemp("model"), seed=11),
            "tree",
            plan,
            worker=WorkerSplit(0.3, 0.2),
            adaptive=False,
            trie=False,
        )
        pids = {role: a.pid for role, a in s.actors.items()}
        try:
            gen = spec.loop.generate(prompt(), 40, set())
        finally:
            spec.close()
    return FakeTrace(
        s.trace_path, json.loads(s.trace_path.read_text()), len(gen.new_ids), gen.stats["verifications"], pids
    )


def launch(*args, home, check=False, input=None):
    env = dict(os.environ, CADENCE_HOME=str(home), CADENCE_KERNELS_DIR=str(paths.kernels_dir()))
    p = subprocess.run(
        [sys.executable, "-m", "launch.cli", *args], capture_output=True, text=True, env=env, timeout=600, input=input
    )
    if check:
        assert p.returncode == 0, p.stderr
    return p


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    args = TINY["qwen"]
    return write_gguf(tmp_path_factory.mktemp("m") / "tiny.gguf", args, random_tensors(args, seed=5))


def one_clear_line(p):
    """The one `launch: ` sentence a failed command ends with (progress lines, e.g. a conversion's, may come before)."""
    assert p.returncode != 0
    lines = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("launch: ")]
    assert "Traceback" not in p.stderr and len(errors) == 1 and lines[-1] == errors[0], p.stderr
    return errors[0]


# -- a real headless Chromium (the trace viewer's and the chat page's tests) ---------------------------------


def _which(*names: str) -> str | None:
    for n in names:
        found = shutil.which(n) or (n if os.path.isabs(n) and os.access(n, os.X_OK) else None)
        if found:
            return found
    return None


CHROMIUM = os.environ.get("CADENCE_CHROMIUM") or _which(
    "chromium", "chromium-browser", "google-chrome", "/usr/lib/chromium/chromium"
)
CHROMEDRIVER = os.environ.get("CADENCE_CHROMEDRIVER") or _which("chromedriver", "/usr/lib/chromium/chromedriver")
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--window-size=1400,900",
    "--force-device-scale-factor=1",
]


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None:
        pytest.skip(
            "no Chromium found (apt-get install chromium chromium-driver, or run .ci/install-browser.sh; "
            "CADENCE_CHROMIUM=/path/to/chrome points at another)"
        )
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.fail("Chromium is here but selenium is not: pip install selenium (.ci/install-browser.sh does)")
    assert CHROMEDRIVER, (
        "Chromium is here but chromedriver is not: apt-get install chromium-driver (.ci/install-browser.sh)"
    )
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in FLAGS:
        opts.add_argument(flag)
    profile = tempfile.mkdtemp(prefix="cadence-chromium-")
    opts.add_argument(f"--user-data-dir={profile}")
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=opts, service=Service(CHROMEDRIVER))
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


# -- `launch serve` in a process of its own ------------------------------------------------------------------------


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(home: Path, args: list[str], logs: Path | None = None):
    """`launch serve ARGS` on a free port with CADENCE_HOME `home`, once /health answers: (its base URL, the process,
    the shared-memory segments there were before it); its stderr in a file in `logs` (default: `home`). A generator:
    the process is killed at its end if still up."""
    import time

    import httpx

    from tests.conftest import shm_segments

    port = free_port()
    env = dict(os.environ, CADENCE_HOME=str(home), CADENCE_KERNELS_DIR=str(paths.kernels_dir()))
    before = shm_segments()
    log = (
        logs or home
    ) / f"serve-{port}.stderr"  # a file, not a pipe: a line per request must never fill a pipe and block
    with open(log, "w") as err:
        p = subprocess.Popen(
            [sys.executable, "-m", "launch.cli", "serve", "--port", str(port), *args],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
            text=True,
        )
    p.stderr = open(log)  # what it said so far, read as tests read a pipe's (`p.stderr.read()`)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if p.poll() is not None:
            pytest.fail(f"launch serve exited: {p.stderr.read()}")
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    else:
        p.kill()
        pytest.fail("launch serve did not become healthy in 120 s")
    yield base, p, before
    if p.poll() is None:
        p.kill()
        p.wait()
