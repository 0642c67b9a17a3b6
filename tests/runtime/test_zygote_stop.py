"""Issue 24: Ctrl-C or SIGTERM while a run's actors load printed a `BrokenPipeError` traceback from
actors/zygote.py (the scheduler had closed the pipe the zygote replies on): a stop during loading is a normal
stop. A real `launch run` process, stopped at a few moments of its loading: the documented exit code, no
traceback, no process and no shared-memory segment left."""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from common import paths
from formats.convert import convert
from formats.source import GGUFSource
from formats.weights import random_tensors
from shm.arena import SEGMENT_NAME
from tests.conftest import TINY
from tests.models.tiny_files import write_gguf
from tests.runtime.conftest import alive, wait_until


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    d = tmp_path_factory.mktemp("zygote")
    gguf = write_gguf(d / "tiny.gguf", TINY["qwen"], random_tensors(TINY["qwen"], seed=5))
    return convert(GGUFSource(gguf), d / "store", "int4")  # converted up front: what loads is the actors


def _as_in_a_terminal():
    """Its own process group with Ctrl-C's default action, as in a terminal (a shell that runs the tests in
    the background hands its children SIGINT ignored)."""
    os.setsid()
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def leftovers(family: list[psutil.Process], pid: int) -> list:
    """The run's processes still alive, and its shared-memory segments (named after the scheduler's pid)."""
    return [c.pid for c in family if alive(c.pid)] + [
        f for f in os.listdir("/dev/shm") if (m := SEGMENT_NAME.match(f)) and m.group(2) == str(pid)
    ]


@pytest.mark.parametrize(
    "sig,to_group,code", [(signal.SIGINT, True, 130), (signal.SIGTERM, False, 143)], ids=["ctrl-c", "sigterm"]
)
def test_a_stop_while_the_actors_load_is_a_normal_stop(store, tmp_path, sig, to_group, code):
    env = dict(os.environ, CADENCE_HOME=str(tmp_path / "home"), CADENCE_KERNELS_DIR=str(paths.kernels_dir()))
    for delay in (0.0, 0.2, 0.5):  # after the "loading" line: the zygote starting, importing, forking the actors
        argv = [
            "run",
            "--mode",
            "target",
            "--target",
            str(store),
            "--prompt",
            "hello",
            "--max-new-tokens",
            "400",
            "--no-monitor",
            "--trace-dir",
            str(tmp_path),
        ]
        p = subprocess.Popen(
            [sys.executable, "-m", "launch.cli", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            preexec_fn=_as_in_a_terminal,
        )  # noqa: PLW1509 - this test starts no threads
        try:
            first = p.stderr.readline()
            assert first.startswith("launch run: loading"), first
            time.sleep(delay)
            family = psutil.Process(p.pid).children(recursive=True)  # the watchdog, the zygote, the actors so far
            if to_group:  # Ctrl-C: the terminal signals the whole foreground group
                os.killpg(p.pid, sig)
            else:
                p.send_signal(sig)
            _, err = p.communicate(timeout=60)
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        assert p.returncode == code and "Traceback" not in err and "Error" not in err, (delay, first + err)
        assert wait_until(lambda f=family, pid=p.pid: not leftovers(f, pid), 5.0), (delay, leftovers(family, p.pid))
