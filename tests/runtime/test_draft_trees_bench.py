"""`python -m bench.draft_trees` (issue 42: what a batch's trees cost the draft): the verdict it plays, the trees it
grows from the real default draft, and the command end to end (tiny sizes; no timing is asserted)."""

import subprocess
import sys
from pathlib import Path

from bench.draft_trees import ACCEPTED, measure, verdict
from common.settings import SamplingConfig, TreeConfig
from speculative.drafter import LocalDraft
from speculative.tree import ROOT
from tests.conftest import real_model

ROOT_DIR = Path(__file__).resolve().parents[2]


def test_the_verdict_accepts_the_likeliest_path_and_the_drafts_next_token():
    m = real_model("qwen2.5-coder-0.5b", "int4")
    ids = m.tokenizer.encode("def fibonacci(n):\n    ")
    d = LocalDraft(m.model)
    d.start(ids[:-1], len(ids) + 64, ids[-1], TreeConfig(width=16), SamplingConfig())
    p = d.propose(16)
    path, new = verdict(p)
    t = p.draft.tree
    assert 1 <= len(path) <= ACCEPTED and len(new) == len(path) + 1
    assert t.nodes[path[0]].parent == ROOT
    assert all(t.nodes[b].parent == a for a, b in zip(path, path[1:]))  # a chain down from the root
    for a, b in zip(path, path[1:]):  # at each level the likeliest child
        assert t.nodes[b].cum == max(t.nodes[k].cum for k in t.children(a))
    assert new[:-1] == [t.nodes[k].token for k in path]
    d.advance(p, path, new)  # the draft takes it as a target's verdict
    assert d.drafter.context[-len(new) :] == new


def test_trees_grow_in_shared_forwards_for_every_generation():
    m = real_model("qwen2.5-coder-0.5b", "int4")
    prompts = [m.tokenizer.encode(t) for t in ("import os\n", "class Stack:\n", "SELECT name FROM")]
    seconds, forwards = measure(m.model, prompts, 8, 4)
    assert seconds > 0 and forwards >= 1


def test_the_command_prints_a_row_for_each_slots_and_width():
    argv = [sys.executable, "-m", "bench.draft_trees", "--slots", "1,2", "--widths", "4", "--cycles", "3"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=ROOT_DIR)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [ln.split("|")[1:-1] for ln in out.stdout.splitlines() if ln[2:3].isdigit()]
    assert [(int(r[0]), int(r[1])) for r in rows] == [(1, 4), (2, 4)]
    assert all(float(r[2]) > 0 and float(r[3]) >= 1 for r in rows)
