"""Issue 24: two processes converting one model at once both failed (one traceback, one "delete the store"),
sharing one `.partial` folder. Now the second waits for the first and uses its store, saying so in one line;
a lock left by a converter killed mid-way is taken over. Real processes: `python -m formats.convert`, what
`ensure_store` runs in a child."""

import os
import signal
import subprocess
import sys
import time

import pytest

from common import paths
from formats.source import sha256_file
from formats.store import WeightStore
from formats.weights import random_tensors
from tests.conftest import TINY
from tests.models.tiny_files import write_gguf


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("lock") / "tiny.gguf", TINY["qwen"], random_tensors(TINY["qwen"], seed=5))


def converter(gguf, home) -> subprocess.Popen:
    env = dict(os.environ, CADENCE_HOME=str(home), CADENCE_KERNELS_DIR=str(paths.kernels_dir()))
    return subprocess.Popen(
        [sys.executable, "-m", "formats.convert", str(gguf), "fp32", "32"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def store_of(gguf, home):
    return home / "stores" / f"tiny-fp32-{sha256_file(gguf)[:12]}"


def caught_converting(gguf, home):
    """A converter caught while it holds the lock with its `.partial` folder begun, or None if it finished first."""
    store = store_of(gguf, home)
    lock, partial = store.with_name(store.name + ".lock"), store.with_name(store.name + ".partial")
    p = converter(gguf, home)
    while p.poll() is None:
        if partial.exists() and lock.exists() and lock.read_text() == str(p.pid):
            return p
        time.sleep(0.001)
    return None


def converted(p: subprocess.Popen) -> tuple[str, str]:
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0 and "Traceback" not in err, err
    return out, err


def test_two_conversions_started_together_convert_once(gguf, tmp_path):
    a, b = converter(gguf, tmp_path / "home"), converter(gguf, tmp_path / "home")
    (a_out, a_err), (b_out, b_err) = converted(a), converted(b)
    assert ("convert tiny -> fp32" in a_err) + ("convert tiny -> fp32" in b_err) == 1, (a_err, b_err)  # one converted
    waited = [out for out in (a_out, b_out) if out]  # the other waited (one line) or found the store done
    assert all(out.startswith("waiting for process ") and out.count("\n") == 1 for out in waited), waited
    assert WeightStore(store_of(gguf, tmp_path / "home")).manifest["source"]["sha256"] == sha256_file(gguf)


def test_the_second_waits_for_the_first_and_uses_its_store(gguf, tmp_path):
    for attempt in range(3):  # a converter that finishes before it is caught is tried again, in a new home
        home = tmp_path / f"home{attempt}"
        a = caught_converting(gguf, home)
        if a is not None:
            break
    else:
        pytest.fail("the tiny conversion never was caught under way")
    os.kill(a.pid, signal.SIGSTOP)  # the first converter, mid-conversion, holds the lock
    try:
        b = converter(gguf, home)
        line = b.stdout.readline()
        assert line == f"waiting for process {a.pid}, which is converting the same model into {store_of(gguf, home)}\n"
        time.sleep(0.5)
        assert b.poll() is None  # it waits
    finally:
        os.kill(a.pid, signal.SIGCONT)
    _, a_err = converted(a)
    b_out, b_err = converted(b)
    assert "convert tiny -> fp32" in a_err and "convert tiny -> fp32" not in b_err and not b_out  # it used a's store
    assert WeightStore(store_of(gguf, home)).manifest["source"]["sha256"] == sha256_file(gguf)


def test_a_lock_left_by_a_killed_converter_is_taken_over(gguf, tmp_path):
    for attempt in range(3):
        home = tmp_path / f"home{attempt}"
        a = caught_converting(gguf, home)
        if a is not None:
            break
    else:
        pytest.fail("the tiny conversion never was caught under way")
    a.kill()  # SIGKILL mid-conversion: its pid stays in the lock file, its `.partial` folder on disk
    a.communicate()
    store = store_of(gguf, home)
    lock, partial = store.with_name(store.name + ".lock"), store.with_name(store.name + ".partial")
    assert lock.read_text() == str(a.pid) and partial.exists()
    out, err = converted(converter(gguf, home))
    assert not out and "convert tiny -> fp32" in err  # no wait: the kernel dropped the dead one's lock
    assert WeightStore(store).manifest["source"]["sha256"] == sha256_file(gguf) and not partial.exists()


def test_a_conversion_killed_for_memory_says_so_and_what_to_do(gguf, tmp_path):
    """A first run under a memory limit smaller than a conversion needs: the kernel kills the converting child, and
    the run's one sentence names the cause and the command that converts it once outside the limit."""
    from bench.cgroup import run_in_cgroup
    from tests.conftest import memory_cgroup_or_skip

    memory_cgroup_or_skip()
    code = (
        "import sys\nfrom common.errors import CadenceError\nfrom formats.convert import ensure_store\n"
        f"try:\n    ensure_store({str(gguf)!r}, 'fp32')\nexcept CadenceError as e:\n    print(e)\n"
        "assert 'torch' not in sys.modules\n"
    )
    env = dict(os.environ, CADENCE_HOME=str(tmp_path), CADENCE_KERNELS_DIR=str(paths.kernels_dir()))
    run = run_in_cgroup([sys.executable, "-c", code], 96 << 20, env=env, timeout=120)  # torch alone needs more
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr
    said = run.stdout.strip()
    assert said.startswith(f"converting {gguf} to fp32 was killed (signal 9), most likely for memory"), said
    assert f"`launch models convert {gguf} --dtype fp32 --group-size 32`" in said
    assert not store_of(gguf, tmp_path).exists()
