"""`launch plan` and `--draft none` on a tiny model, as a user runs them."""

import json

import pytest

from speculative.lookup import PromptLookup
from tests.launch.conftest import launch, one_clear_line


def test_plan_prints_what_stays_what_streams_and_the_smallest_budget_per_mode(tiny_gguf, tmp_path):
    p = launch(
        "plan",
        "--target",
        str(tiny_gguf),
        "--draft",
        str(tiny_gguf),
        "--dtype",
        "int4",
        "--memory-budget",
        "2GiB",
        home=tmp_path,
        check=True,
    )
    out = p.stdout
    assert "draft weights" in out and "KV caches" in out and "code pages" in out and "of 2.00 GiB budget" in out
    assert "resident: layer 0-1; head 0" in out and "streamed: nothing" in out
    table = out.split("smallest budget per mode:")[1].strip().splitlines()
    assert [ln.strip().rsplit(None, 2)[0] for ln in table] == ["std", "stdpl", "chain", "tree", "tree --draft none"]
    assert all(ln.strip().endswith("MiB") for ln in table)


def test_plan_under_a_budget_too_small_says_so_and_still_lists_the_smallest(tiny_gguf, tmp_path):
    p = launch(
        "plan",
        "--target",
        str(tiny_gguf),
        "--draft",
        str(tiny_gguf),
        "--dtype",
        "int4",
        "--memory-budget",
        "100MiB",
        home=tmp_path,
    )
    assert p.returncode == 1 and "too small" in p.stdout and "smallest budget that works is" in p.stdout
    assert "tree --draft none" in p.stdout and "Traceback" not in p.stderr


def test_plan_needs_a_budget(tiny_gguf, tmp_path):
    line = one_clear_line(launch("plan", "--target", str(tiny_gguf), home=tmp_path))
    assert "--memory-budget" in line


def test_draft_none_over_actors_equals_the_target(tiny_gguf, tmp_path):
    """Tree mode with no draft model: the trie's candidates, verified by the target, change no token."""
    prompt = "a b c d a b c d a b c d a b"
    rows = {}
    for mode, extra in (("target", []), ("tree", ["--draft", "none", "--memory-budget", "4GiB"])):
        out = tmp_path / f"{mode}.json"
        launch(
            "run",
            "--mode",
            mode,
            *extra,
            "--target",
            str(tiny_gguf),
            "--dtype",
            "int4",
            "--prompt",
            prompt,
            "--max-new-tokens",
            "40",
            "--no-monitor",
            "--json",
            str(out),
            home=tmp_path / "home",
            check=True,
        )
        rows[mode] = json.loads(out.read_text())[0]
    assert rows["tree"]["new_token_ids"] == rows["target"]["new_token_ids"]
    assert rows["tree"]["draft"] is None and rows["tree"]["stats"]["draft_forwards"] == 0


def test_draft_none_refuses_chain_mode(tiny_gguf, tmp_path):
    line = one_clear_line(
        launch("run", "--mode", "chain", "--draft", "none", "--target", str(tiny_gguf), home=tmp_path)
    )
    assert "--mode tree" in line


def test_prompt_lookup_proposes_what_followed_the_same_words_before():
    look = PromptLookup(max_nodes=4)
    look.start([5, 6, 7, 8, 9, 5, 6], first=[7])
    tree = look.tree()
    assert tree.tokens[:2] == [8, 9] and tree.parents[:2] == [-1, 0]  # ... 5 6 7 -> 8 9, as before
    assert tree.trie_nodes == len(tree.tokens)
    look.push([1])
    assert look.tree() is None  # nothing ever followed 7 1


@pytest.mark.real
def test_a_budget_no_plan_fits_names_the_smallest_any_plan_reaches():
    """`--draft auto` picks the 0.5B; at 300 MiB neither its plan nor the trie's alone fits: the refusal names the
    smallest budget of the run's plans (the trie's, as `tree --draft none` lists it), not the draft's."""
    import re

    from common import paths

    p = launch("plan", "--memory-budget", "300MiB", home=paths.home())
    said = re.search(r"too small: .* the smallest budget that works is (\d+) MiB", p.stdout)
    listed = re.search(r"tree --draft none\s+(\d+) MiB", p.stdout)
    assert p.returncode == 1 and said and listed and said.group(1) == listed.group(1), p.stdout + p.stderr
    assert "the draft (" not in said.group(0)
