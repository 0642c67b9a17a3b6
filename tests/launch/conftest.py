"""A real trace for the trace tools and the viewer: one fake-actor run, once per session."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from scheduler.runtime import Scheduler
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
    with Scheduler(small_config(d, plan)) as s:
        spec = speculation(s, fake_model(tmp_path_factory.mktemp("model"), seed=11), "tree", plan,
                           worker={"share": 0.3, "columns": 0.2}, adaptive=False, trie=False)
        pids = {role: a.pid for role, a in s.actors.items()}
        try:
            gen = spec.generate(prompt(), 40, set())
        finally:
            spec.close()
    return FakeTrace(s.trace_path, json.loads(s.trace_path.read_text()), len(gen.new_ids), gen.stats["verifications"], pids)
