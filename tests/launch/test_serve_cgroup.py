"""The server in a physical memory cgroup of its budget (issue 56): `launch serve` under a budget near 768 MiB (see
`_settled_budget`) with the real default pair, two clients at once through the official client (one held to a JSON grammar, one sampled); what
its processes hold (anonymous and shared memory, the cgroup's own count) stays within what its plan says they hold
(the plan keeps room for what requests may bring: longer prompts, more grammars), and nothing was OOM-killed. Its plan is the one `launch plan --for serve` prints with the same options (the real vocabulary: the
encoder a server keeps, the grammars' view of it)."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import threading

import pytest

from tests.conftest import memory_cgroup_or_skip

pytestmark = [pytest.mark.real, pytest.mark.slow]
BUDGET = 768 << 20


def _plan(budget: int) -> str:
    cmd = [sys.executable, "-m", "launch.cli", "plan", "--for", "serve", "--memory-budget", str(budget)]
    return subprocess.run([*cmd, "--parallel", "2", "--no-trace"], capture_output=True, text=True, check=True).stdout


def _settled_budget() -> int:
    """The plan's total at 768 MiB and half a streaming slot more. Each process measures its own memory as it
    decides, the server's a few MiB apart from `launch plan`'s; where the budget leaves room within that of one
    more resident group, the two may keep one group apart, each right for what it measured. Half a slot of room
    on either side of the total keeps one decision."""
    import re

    out = _plan(BUDGET)
    total = int(re.search(r"^  total +(\d+) MiB of", out, re.M).group(1))
    slot = int(re.search(r"^  streaming slots \(\d+ x (\d+) MiB\)", out, re.M).group(1))
    return (total + slot // 2) << 20


def test_the_servers_footprint_under_its_budget_holds_its_plan():
    memory_cgroup_or_skip()
    import httpx
    from openai import OpenAI

    from bench.prompt_cache import pair_files, server

    from tests.launch.test_door_plans import _from_door, _from_plan, _same

    budget = _settled_budget()
    plan = _plan(budget)
    args = ["--memory-budget", str(budget), "--parallel", "2", "--no-trace", "--quiet", "--no-monitor"]
    log = tempfile.TemporaryFile("w+")
    with log, server(args, budget, pair_files(), log) as (url, cg):
        client = OpenAI(base_url=url + "/v1", api_key="none", timeout=600, max_retries=0)
        texts, model = {}, client.models.list().data[0].id

        def ask(i: int) -> None:
            if i == 0:  # a grammar: its view of the vocabulary comes into memory
                texts[i] = client.chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": "A JSON object with a name."}],
                    response_format={"type": "json_object"},
                    max_tokens=8,
                    temperature=0,
                )
            else:  # sampled: its distributions
                texts[i] = client.completions.create(model=model, prompt="def f(x):", max_tokens=8, temperature=0.7)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        metrics = httpx.get(url + "/metrics", timeout=30).text
        planned = next(float(ln.split()[1]) for ln in metrics.splitlines() if ln.startswith("cadence_memory_planned"))
        held, oom = cg.peak_held, cg.oom_kills()
        log.seek(0)
        _same(_from_plan(plan), _from_door(log.read()))
    assert all(texts[i].usage.completion_tokens > 0 for i in range(2))
    assert oom == 0 and 0 < held <= planned <= budget, (held >> 20, planned / 2**20, oom)
