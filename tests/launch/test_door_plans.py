"""One decision for every door (issue 56): `launch plan --for DOOR` with a door's options prints the plan that door
runs, read from what `launch run`, `chat` and `serve` print as they start (their models loaded, their processes
up); and `launch plan` alone says where the doors that take requests decide otherwise."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.launch.conftest import launch, serve


def _from_plan(out: str) -> dict:
    """What `launch plan` decided: the draft, the slots, each slot's context, the groups resident, the total."""
    head = next(ln for ln in out.splitlines() if ln.startswith("tree "))
    slots = re.search(r"; (\d+) slots \(--parallel\) sharing an? (?:\w+ )?KV pool of \d+ x (\d+) tokens", head)
    one = re.search(r"KV caches for a context of (\d+) tokens", head)
    total = re.search(r"^  total +(\d+) MiB of", out, re.M)
    resident = re.search(r"^  target resident \((\d+) groups?\)", out, re.M)
    return dict(
        draft=re.search(r"(draft \S+|no draft model)", head).group(1),
        slots=int(slots.group(1)) if slots else 1,
        context=int(slots.group(2) if slots else one.group(1)),
        resident=None if "streamed: nothing" in out else int(resident.group(1)),  # None: every group
        total=int(total.group(1)),
    )


def _from_door(err: str) -> dict:
    """What a door printed as it started: its run's line and its memory plan's."""
    line = next(ln for ln in err.splitlines() if ln.startswith("tree ") and "; context " in ln)
    ctx = re.search(r"; context (?:(\d+) slots of )?(\d+) tokens", line)
    mem = re.search(r"memory plan: (\d+) MiB of [^:,]+(?::|,) (?:(\d+) target groups resident|every)", err)
    return dict(
        draft=re.search(r"(draft \S+|no draft model)", line).group(1).rstrip(";"),
        slots=int(ctx.group(1) or 1),
        context=int(ctx.group(2)),
        resident=int(mem.group(2)) if mem.group(2) else None,
        total=int(mem.group(1)),
    )


def _same(planned: dict, ran: dict) -> None:
    """The same decisions; the totals within 4 MiB (each process measures its own memory as it decides)."""
    assert {k: v for k, v in planned.items() if k != "total"} == {k: v for k, v in ran.items() if k != "total"}
    assert abs(planned["total"] - ran["total"]) <= 4, (planned, ran)


@pytest.fixture(scope="module")
def opts(tiny_gguf):
    return ["--target", str(tiny_gguf), "--draft", str(tiny_gguf), "--memory-budget", "640MiB", "--no-trace"]


def test_launch_plan_for_each_door_is_the_plan_that_door_runs(opts, tmp_path):
    home = tmp_path / "home"
    launch("plan", *opts, home=home, check=True)  # converts the model, measures the costs: a first run holds more
    planned = {d: _from_plan(launch("plan", "--for", d, *opts, home=home, check=True).stdout) for d in DOORS[1:]}
    prompt = ["--prompt", "a b c", "--max-new-tokens", "2"]  # a run sizes its caches for its prompt
    planned["run"] = _from_plan(launch("plan", *opts, *prompt, home=home, check=True).stdout)
    ran = launch("run", *opts, *prompt, "--no-monitor", home=home, check=True)
    _same(planned["run"], _from_door(ran.stderr))
    chat = launch("chat", *opts, "--max-new-tokens", "2", home=home, input="hello\n/exit\n")
    assert chat.returncode == 0, chat.stderr
    _same(planned["chat"], _from_door(chat.stderr))
    gen = serve(home, opts)
    _, p, _ = next(gen)
    try:
        _same(planned["serve"], _from_door(p.stderr.read()))
    finally:
        p.terminate()
        p.wait(30)
    assert planned["serve"]["slots"] > 1  # serve's own --parallel 0: as many slots as the budget holds


DOORS = ("run", "chat", "serve")


def test_launch_plan_says_where_the_doors_that_take_requests_decide_otherwise():
    """At 768 MiB (the default pair, four slots) a server keeps room for grammars and sampled requests, and its
    process holds the HTTP front: `launch plan` says what that changes, and `--for serve` shows it."""
    budget = ["plan", "--memory-budget", "768MiB", "--parallel", "4"]
    cli = [sys.executable, "-m", "launch.cli"]
    out = subprocess.run(cli + budget, capture_output=True, text=True, timeout=600, check=True).stdout
    line = next(ln for ln in out.splitlines() if "`launch serve` with these options" in ln)
    assert "for grammars" in line and "`launch plan --for serve`" in line
    served = subprocess.run(cli + budget + ["--for", "serve"], capture_output=True, text=True, timeout=600).stdout
    assert "grammars' view of the vocabulary" in served and "`launch serve` with these options" not in served
