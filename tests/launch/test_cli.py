"""The `launch` command as a user meets it: JSON rows, and bad input ending in one clear sentence."""

import json
import pytest

from engine.rows import ROW_FIELDS
from tests.launch.conftest import launch, one_clear_line


def test_run_writes_the_json_contract(tiny_gguf, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        '{"id": "a", "kind": "complete", "prompt": "the cat"}\n{"id": "b", "kind": "copy", "prompt": "in he"}\n'
    )
    out = tmp_path / "rows.json"
    launch(
        "run",
        "--mode",
        "target",
        "--target",
        str(tiny_gguf),
        "--dtype",
        "int4",
        "--prompts",
        str(prompts),
        "--max-new-tokens",
        "5",
        "--json",
        str(out),
        home=tmp_path / "home",
        check=True,
    )
    rows = json.loads(out.read_text())
    assert [r["id"] for r in rows] == ["a", "b"]
    for r in rows:
        assert set(ROW_FIELDS) <= set(r)
        assert len(r["new_token_ids"]) == 5 and r["wall_s"] > 0 and r["peak_rss_bytes"] > 0
        assert r["tokens_per_s"] == pytest.approx(5 / r["wall_s"], rel=0.01)
    assert rows[0]["chat"] is False and rows[1]["chat"] is True  # --chat auto: instructions get the template


def test_sampling_is_reproducible_with_a_seed_in_every_mode(tiny_gguf, tmp_path):
    """The same seed and controls give the same tokens twice, and the tree over the actors (the draft and verifier
    processes) gives the target's alone."""
    runs = []
    for mode in ("target", "target", "tree"):
        out = tmp_path / "s.json"
        launch(
            "run",
            *("--mode", mode, "--target", str(tiny_gguf), "--draft", str(tiny_gguf), "--prompt", "in"),
            *("--max-new-tokens", "12", "--temperature", "1.0", "--top-p", "0.9", "--top-k", "20", "--seed", "3"),
            *("--frequency-penalty", "0.5", "--repeat-penalty", "1.1", "--json", str(out)),
            home=tmp_path / "home",
            check=True,
        )
        runs.append(json.loads(out.read_text())[0]["new_token_ids"])
    assert runs[0] == runs[1] == runs[2]


def test_unknown_model(tmp_path):
    line = one_clear_line(launch("run", "--target", "gpt-17", "--prompt", "x", home=tmp_path))
    assert "unknown model 'gpt-17'" in line


def test_missing_file(tmp_path):
    line = one_clear_line(
        launch("run", "--mode", "target", "--target", str(tmp_path / "absent.gguf"), "--prompt", "x", home=tmp_path)
    )
    assert "absent.gguf" in line


def test_corrupt_gguf(tiny_gguf, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(tiny_gguf.read_bytes()[:3000])
    line = one_clear_line(launch("run", "--mode", "target", "--target", str(bad), "--prompt", "x", home=tmp_path))
    assert "bad.gguf" in line and ("truncated" in line or "damaged" in line)


def test_prompt_longer_than_context(tiny_gguf, tmp_path):
    line = one_clear_line(
        launch("run", "--mode", "target", "--target", str(tiny_gguf), "--prompt", "the cat " * 400, home=tmp_path)
    )
    assert "the prompt has" in line and "the context holds 512" in line and "--context" in line


def test_bad_prompt_file(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text("not json\n")
    line = one_clear_line(launch("run", "--prompts", str(f), home=tmp_path))
    assert "p.jsonl:1" in line


def test_draft_ahead_out_of_range(tiny_gguf, tmp_path):
    line = one_clear_line(
        launch(
            "run",
            "--target",
            str(tiny_gguf),
            "--draft",
            str(tiny_gguf),
            "--draft-ahead",
            "99",
            "--prompt",
            "x",
            home=tmp_path,
        )
    )
    assert "draft-ahead" in line and "0..64" in line


@pytest.mark.parametrize(
    "extra, says",
    [
        (["--column-share", "0.5"], "add --sparse-worker"),
        (["--sparse-worker", "--column-share", "1.5"], "[0, 1)"),
        (
            ["--sparse-worker", "--column-share", "0.5", "--memory-budget", "auto"],
            "drop --memory-budget or --column-share",
        ),
    ],
)
def test_column_share_needs_the_worker_a_share_and_a_resident_target(tiny_gguf, tmp_path, extra, says):
    line = one_clear_line(
        launch("run", "--target", str(tiny_gguf), "--draft", str(tiny_gguf), *extra, "--prompt", "x", home=tmp_path)
    )
    assert says in line


def test_models_list(tmp_path):
    p = launch("models", "list", home=tmp_path, check=True)
    assert "qwen2.5-coder-1.5b" in p.stdout


@pytest.mark.parametrize("argv", [["--help"], ["models", "list"], ["models", "pull", "hf:nope"], ["plan", "--help"]])
def test_the_commands_that_load_no_model_import_no_torch(argv, tmp_path):
    """`launch --help` builds every command's options, `launch models ...` lists and fetches: none of it needs
    torch, whose import alone takes seconds (4.4 s for `launch models pull` here before, 0.6 s without)."""
    import os
    import subprocess
    import sys

    from common import paths
    from shm.watchdog import REPO_ROOT

    code = (
        "import runpy, sys\n"
        f"sys.argv = ['launch', *{argv!r}]\n"
        "try:\n    runpy.run_module('launch.cli', run_name='__main__')\nexcept SystemExit:\n    pass\n"
        "print('torch' in sys.modules, file=sys.stderr)\n"
    )
    env = dict(os.environ, CADENCE_HOME=str(tmp_path), CADENCE_KERNELS_DIR=str(paths.kernels_dir()))
    p = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=120
    )
    assert p.stderr.splitlines()[-1] == "False", p.stderr


def test_bench_cgroup_runs_each_mode_under_the_budget(tiny_gguf, tmp_path):
    """`launch bench --memory-budget auto --cgroup`: every mode in its own cgroup of the budget,
    rows carry the budget and the cgroup's peak, which stays under it; streamed modes stay lossless."""
    from tests.runtime.test_cgroup import INFO, WHY

    if INFO is None:
        pytest.skip(f"no usable memory cgroup here: {WHY}")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "kind": "complete", "prompt": "the cat"}\n')
    out = tmp_path / "rows.json"
    launch(
        "bench",
        "--target",
        str(tiny_gguf),
        "--draft",
        str(tiny_gguf),
        "--dtype",
        "int4",
        "--prompts",
        str(prompts),
        "--max-new-tokens",
        "6",
        "--memory-budget",
        "auto",
        "--cgroup",
        "--modes",
        "std,stdpl,tree",
        "--baselines",
        "none",
        "--json",
        str(out),
        home=tmp_path / "home",
        check=True,
    )
    rows = json.loads(out.read_text())
    assert sorted(r["mode"] for r in rows) == ["std", "stdpl", "tree"]
    for r in rows:
        assert 0 < r["peak_memory_bytes"] <= r["memory_budget_bytes"], r["mode"]
        assert r["new_token_ids"] == rows[0]["new_token_ids"], r["mode"]


def test_bench_cgroup_needs_a_budget(tmp_path):
    line = one_clear_line(launch("bench", "--cgroup", home=tmp_path))
    assert "--memory-budget" in line
