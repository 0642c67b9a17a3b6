"""Issue 17: every way a user can hand `launch` something wrong ends in one sentence, a non-zero exit
and nothing lost; driven through the real CLI as a subprocess."""

import json
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

from common import paths
from common.errors import CadenceError
from engine.rows import ROW_FIELDS, write_rows
from formats.weights import random_tensors
from tests.conftest import TINY
from tests.launch.conftest import launch, one_clear_line
from tests.models.tiny_files import write_gguf


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    args = TINY["qwen"]
    return write_gguf(tmp_path_factory.mktemp("m") / "tiny.gguf", args, random_tensors(args, seed=5))


@contextmanager
def read_only(folder: Path):
    """`folder` unwritable for this user: chmod does not stop root, the immutable flag does."""
    if os.geteuid() != 0:
        folder.chmod(0o555)
        undo = ["chmod", "755", str(folder)]
    elif subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode == 0:
        undo = ["chattr", "-i", str(folder)]
    else:
        pytest.skip("no way to make a folder read-only for root here (chattr +i failed)")
    try:
        yield folder
    finally:
        subprocess.run(undo, check=True)


def _garbled(tiny_gguf: Path, tmp_path: Path, at: int) -> Path:
    """The tiny GGUF with 8 header bytes at `at` set to 0xff: a count or a length of about 2**64."""
    data = bytearray(tiny_gguf.read_bytes())
    data[at : at + 8] = b"\xff" * 8
    bad = tmp_path / "garbled.gguf"
    bad.write_bytes(bytes(data))
    return bad


# 1. damaged GGUF files, to `run --target` and to `models convert`
@pytest.mark.parametrize("command", [["run", "--mode", "target", "--prompt", "x", "--target"], ["models", "convert"]])
@pytest.mark.parametrize("at", [16, 24])  # the field count; the first key's length (was an OverflowError)
def test_garbled_gguf_header(tiny_gguf, tmp_path, command, at):
    bad = _garbled(tiny_gguf, tmp_path, at)
    line = one_clear_line(launch(*command, str(bad), home=tmp_path / "home"))
    assert "garbled.gguf is a damaged GGUF file" in line and "re-download it" in line


@pytest.mark.parametrize("command", [["run", "--mode", "target", "--prompt", "x", "--target"], ["models", "convert"]])
def test_empty_gguf(tmp_path, command):
    empty = tmp_path / "empty.gguf"
    empty.touch()
    line = one_clear_line(launch(*command, str(empty), home=tmp_path / "home"))
    assert "empty.gguf is empty, too short to be a GGUF model" in line


# 2. a CADENCE_HOME that cannot be written
def test_home_below_a_file(tiny_gguf, tmp_path):
    (tmp_path / "file").touch()
    home = tmp_path / "file" / "home"
    line = one_clear_line(launch("run", "--mode", "target", "--target", str(tiny_gguf), "--prompt", "x", home=home))
    assert f"cannot write to {home / 'stores'}" in line and "CADENCE_HOME" in line
    line = one_clear_line(launch("models", "convert", "smollm2-135m", home=home))  # a pull, refused before the network
    assert f"cannot write to {home / 'models'}" in line


def test_read_only_home_runs_its_stores_and_refuses_a_new_format(tiny_gguf, tmp_path):
    home = tmp_path / "home"
    run = ("run", "--mode", "target", "--target", str(tiny_gguf), "--prompt", "x", "--max-new-tokens", "2")
    launch(*run, "--dtype", "int4", home=home, check=True)
    with read_only(home / "stores"):
        launch(*run, "--dtype", "int4", home=home, check=True)  # what is converted still runs
        line = one_clear_line(launch(*run, "--dtype", "int8", home=home))
    assert f"cannot write to {home / 'stores'}" in line and "CADENCE_HOME" in line


# 3. an unwritable --json path is refused before the run
@pytest.mark.parametrize("where", ["below a file", "a folder"])
def test_unwritable_json_is_refused_before_the_run(tiny_gguf, tmp_path, where):
    (tmp_path / "file").touch()
    out = tmp_path / "file" / "rows.json" if where == "below a file" else tmp_path
    home = tmp_path / "home"
    line = one_clear_line(
        launch("run", "--mode", "target", "--target", str(tiny_gguf), "--prompt", "x", "--json", str(out), home=home)
    )
    assert line.startswith(f"launch: --json {out} ")
    assert not (home / "stores").exists()  # nothing was converted, nothing ran


@pytest.mark.parametrize(
    "flags,says",
    [
        (["--prompt-cache", "FILE"], "is a file; give a folder"),
        (["--prompt-cache-ram", "lots"], "cannot read the memory size 'lots'"),
    ],
)
def test_a_prompt_cache_that_cannot_be_is_refused_before_the_run(tiny_gguf, tmp_path, flags, says):
    (tmp_path / "FILE").touch()
    flags = [str(tmp_path / f) if f == "FILE" else f for f in flags]
    home = tmp_path / "home"
    line = one_clear_line(
        launch("run", "--mode", "target", "--target", str(tiny_gguf), "--prompt", "x", *flags, home=home)
    )
    assert says in line


def test_rows_are_saved_elsewhere_when_the_write_fails(tmp_path):
    (tmp_path / "file").touch()
    rows = [{f: 0 for f in ROW_FIELDS}]
    with pytest.raises(CadenceError, match="the 1 rows were saved to") as e:
        write_rows(tmp_path / "file" / "rows.json", rows)
    saved = Path(str(e.value).rsplit(" to ", 1)[1].split(" instead")[0])
    assert json.loads(saved.read_text()) == rows
    saved.unlink()


# 4. stdout closed by its reader (`launch run | head`)
def test_closed_stdout_ends_quietly(tiny_gguf, tmp_path):
    env = dict(os.environ, CADENCE_HOME=str(tmp_path / "home"), CADENCE_KERNELS_DIR=str(paths.kernels_dir()))
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "launch.cli",
            "run",
            "--mode",
            "target",
            "--target",
            str(tiny_gguf),
            "--prompt",
            "the cat",
            "--max-new-tokens",
            "20",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
    )
    p.stdout.close()  # the reader is gone before the first token
    err = p.stderr.read()
    assert p.wait(600) in (0, 141), err
    assert "Traceback" not in err and "Exception ignored" not in err and "BrokenPipe" not in err, err


# 5. --threads
def test_negative_threads(tiny_gguf, tmp_path):
    line = one_clear_line(
        launch("run", "--mode", "target", "--target", str(tiny_gguf), "--prompt", "x", "--threads", "-1", home=tmp_path)
    )
    assert "--threads -1" in line and "0 for all cores" in line


# 6. prompt files
@pytest.mark.parametrize(
    "bad, why",
    [
        ("[1, 2]", "an array, not an object"),
        ('"text"', "a string, not an object"),
        ('{"id": "a"}', 'no "prompt" field'),
        ('{"prompt": 7}', "a number, not a string"),
    ],
)
def test_prompt_line_that_is_not_a_prompt(tmp_path, bad, why):
    f = tmp_path / "p.jsonl"
    f.write_text(f'{{"prompt": "fine"}}\n{bad}\n')
    line = one_clear_line(launch("run", "--mode", "target", "--prompts", str(f), home=tmp_path))
    assert f"{f}:2 is not a prompt line" in line and why in line


# 7. --profile given something `launch profile` did not write
@pytest.mark.parametrize(
    "text, says",
    [
        ("not json", "is not JSON"),
        ("[1]", "is not a profile written by `launch profile`"),
        ('{"width": 4}', "is not a profile written by `launch profile`"),
    ],
)
def test_wrong_profile(tmp_path, text, says):
    prof = tmp_path / "prof.json"
    prof.write_text(text)
    line = one_clear_line(launch("run", "--mode", "target", "--prompt", "x", "--profile", str(prof), home=tmp_path))
    assert says in line and "launch profile --out" in line


# 8. files that are not traces, to `trace summary`
@pytest.mark.parametrize(
    "text, says",
    [
        (json.dumps([{f: [] for f in ROW_FIELDS}]), "result rows `launch run --json` writes"),
        ("", "is empty, not a trace"),
        ("{not json", "is not a JSON trace"),
        ('{"a": 1}', "has no traceEvents"),
    ],
)
def test_trace_summary_of_something_else(tmp_path, text, says):
    f = tmp_path / "rows.json"
    f.write_text(text)
    line = one_clear_line(launch("trace", "summary", str(f), home=tmp_path))
    assert says in line


# 9. an int4 group size the format does not have
def test_group_size_refused_before_reading(tiny_gguf, tmp_path):
    p = launch("models", "convert", str(tiny_gguf), "--dtype", "int4", "--group-size", "48", home=tmp_path / "home")
    line = one_clear_line(p)
    assert "--group-size 48" in line and "32 or 64" in line
    assert not (tmp_path / "home").exists()  # nothing hashed, nothing converted


def test_version(tmp_path):
    p = launch("--version", home=tmp_path, check=True)
    assert p.stdout.startswith("cadence ") and p.stdout.split()[1][0].isdigit()


def test_every_help_shows_defaults():
    """Each option that has a default shows it, in every command this checkout has, the plugins' too."""
    import argparse

    import launch as launch_pkg
    from launch.cli import COMMANDS, _has_default, build_parser, plugins
    from launch.options import show_all

    here = Path(launch_pkg.__file__).parent
    names = [n for n in COMMANDS if (here / f"cmd_{n}.py").is_file()] + list(plugins())
    assert {"bench", "profile", "runtime_bench"} <= set(names)  # bench/'s, found as plugins
    show_all(True)  # as `--help-all`: every option listed
    for name in names:
        parsers = [build_parser(name)]
        while parsers:
            parser = parsers.pop()
            for action in parser._actions:
                if isinstance(action, argparse._SubParsersAction):
                    parsers += action.choices.values()
                elif action.option_strings and _has_default(action):
                    assert "default" in parser._get_formatter()._format_action(action), (
                        parser.prog,
                        action.option_strings,
                    )
    show_all(False)


def test_help_lists_the_common_options_and_help_all_every_one(tmp_path):
    from engine.options import OPTIONS

    short = launch("run", "--help", home=tmp_path, check=True).stdout
    full = launch("run", "--help-all", home=tmp_path, check=True).stdout
    assert len(short.splitlines()) <= 70 and "--help-all" in short
    assert all((o.flag in short) == o.common for o in OPTIONS) and all(o.flag in full for o in OPTIONS)
    listed = [ln.split()[0] for ln in short.split("options:", 1)[1].splitlines() if ln.startswith("  --")]
    assert listed[:6] == ["--prompt", "--prompts", "--json", "--target", "--mode", "--memory-budget"]


def test_models_rm(tiny_gguf, tmp_path):
    from pulls import registry

    home = tmp_path / "home"
    spec = registry.spec("smollm2-135m")
    models, stores = home / "models", home / "stores"
    models.mkdir(parents=True)
    (models / spec.filename).write_bytes(b"x")
    (models / f"{spec.filename}.sha256").write_text(spec.sha256)
    for fmt in ("int8", "int4g32"):
        (stores / f"{spec.name}-{fmt}-{spec.sha256[:12]}").mkdir(parents=True)
    p = launch("models", "rm", "smollm2-135m", "--stores-only", home=home, check=True)
    assert p.stdout.count("removed") == 2 and not list(stores.glob("smollm2*")) and (models / spec.filename).exists()
    launch("models", "rm", "smollm2-135m", home=home, check=True)
    assert not list(models.iterdir())
    assert "nothing to remove for smollm2-135m" in one_clear_line(launch("models", "rm", "smollm2-135m", home=home))

    store = Path(
        launch("models", "convert", str(tiny_gguf), "--dtype", "int8", home=home, check=True).stdout.split()[0]
    )
    assert "unknown model or weight store 'nope'" in one_clear_line(
        launch("models", "rm", store.name, "nope", home=home)
    )
    assert store.is_dir()  # every name is checked before anything is removed
    launch("models", "rm", store.name, home=home, check=True)
    assert not store.exists()
