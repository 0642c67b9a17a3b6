"""A real trace for the trace tools and the viewer: one fake-actor run, once per session."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from scheduler.pipeline import run_pipeline
from scheduler.runtime import Scheduler
from tests.runtime.fake_run import policy_for, small_config, spawn_fakes


@dataclass(frozen=True)
class FakeTrace:
    path: Path
    trace: dict
    tokens: int
    rounds: int
    pids: dict  # role -> pid


@pytest.fixture(scope="session")
def fake_trace(tmp_path_factory) -> FakeTrace:
    d = tmp_path_factory.mktemp("traces")
    with Scheduler(small_config(d, max_tokens=40)) as s:
        pids = spawn_fakes(s, seed=11)
        res = run_pipeline(s, policy_for(s))
    return FakeTrace(s.trace_path, json.loads(s.trace_path.read_text()), res.tokens, res.rounds, pids)
