"""The Python API (`import cadence`): the README's example on a tiny model, streaming, chat turns
that reuse the KV cache and still give the target's own tokens, and nothing left after `close`."""

from __future__ import annotations

import psutil
import pytest

import cadence
from tests.conftest import shm_segments


def _actors() -> list:
    return [c for c in psutil.Process().children(recursive=True) if c.status() != psutil.STATUS_ZOMBIE]


def test_the_readme_example_runs(tiny_gguf):
    before = shm_segments()
    with cadence.LLM(target=str(tiny_gguf), draft=str(tiny_gguf), memory_budget="2GiB") as llm:
        done = llm.generate("def fibonacci(n):", max_new_tokens=12)
        assert isinstance(done, cadence.Completion) and len(done.token_ids) == 12 and done.finish_reason == "length"
        chunks = list(llm.stream("def fibonacci(n):", max_new_tokens=12))
        assert "".join(c.text for c in chunks) == done.text == chunks[-1].completion.text
        assert all(c.completion is None for c in chunks[:-1]) and chunks[-1].finish_reason == "length"
        assert sum(len(c.tokens) for c in chunks) == 12
        reply = llm.chat([{"role": "user", "content": "What is a mutex?"}], max_new_tokens=8)
        assert reply.prompt_tokens > 0 and reply.tokens_per_s > 0 and "<|im_end|>" not in reply.text
        assert llm.plan is not None and llm.plan.budget == 2 << 30
        assert _actors()  # the runtime's processes run while the LLM is open
    assert not _actors() and shm_segments() <= before  # and are gone after


def test_a_second_turn_reuses_the_cache_and_gives_what_a_fresh_start_gives(tiny_gguf):
    first = [{"role": "user", "content": "the cat sat on the"}]
    with cadence.LLM(target=str(tiny_gguf), draft=str(tiny_gguf)) as llm:
        a1 = llm.chat(first, max_new_tokens=10)
        second = first + [{"role": "assistant", "content": a1.text}, {"role": "user", "content": "and then?"}]
        a2 = llm.chat(second, max_new_tokens=10)
    assert a2.stats["reused_prompt_tokens"] > 0  # the first turn's prompt (and answer) came from the cache
    with cadence.LLM(target=str(tiny_gguf), draft=str(tiny_gguf)) as fresh:
        ref = fresh.chat(second, max_new_tokens=10)
    assert ref.stats["reused_prompt_tokens"] == 0 and a2.token_ids == ref.token_ids


def test_sampling_per_call_and_bad_messages(tiny_gguf):
    with cadence.LLM(target=str(tiny_gguf), mode="target") as llm:
        a = llm.generate("once", max_new_tokens=10, temperature=1.0, seed=3)
        b = llm.generate("once", max_new_tokens=10, temperature=1.0, seed=3)
        greedy = llm.generate("once", max_new_tokens=10)
        assert a.token_ids == b.token_ids  # a seed reproduces a sampled generation
        assert greedy.token_ids == llm.generate("once", max_new_tokens=10).token_ids
        penalized = llm.generate("once", max_new_tokens=10, repetition_penalty=1.5, repeat_last_n=-1)
        assert penalized.token_ids != greedy.token_ids  # a penalty is applied, under greedy too
        with pytest.raises(cadence.CadenceError, match="messages must be"):
            llm.chat([{"role": "user"}])
        with pytest.raises(cadence.CadenceError, match="unknown argument 'top_n'"):
            llm.generate("once", top_n=3)
        with pytest.raises(cadence.CadenceError, match="min_p=2"):
            llm.generate("once", min_p=2)


def test_a_generation_that_asks_no_length_stops_at_the_bound_and_says_so(tiny_gguf, capsys):
    """`launch run` and `chat` bound a generation that asks no number of new tokens (a greedy small model may loop
    until its context is full): at the bound, or at the context's end where that comes first; a number given wins;
    the line that says so."""
    from launch.cmd_run import bounded

    with cadence.LLM(target=str(tiny_gguf), draft=str(tiny_gguf), runtime="inproc", no_trace=True) as llm:
        llm.runner.bound_new_tokens(7)
        done = llm.generate("the cat sat on the")
        assert len(done.token_ids) <= 7 and (done.finish_reason == "stop" or len(done.token_ids) == 7)
        assert len(llm.generate("the cat sat on the", max_new_tokens=9).token_ids) in range(1, 10)
        llm.runner.bound_new_tokens(10_000)  # past the context's end: the context bounds it, no refusal; the trie
        # knows the text before, and near the end its candidates must fit the rows left (they once overran them)
        assert llm.generate("the cat", max_new_tokens=None).finish_reason in ("stop", "length")
    long = done.__class__(**{**done.__dict__, "token_ids": [1] * 1024, "finish_reason": "length"})
    bounded(None, long, "launch run")
    bounded(1024, long, "launch run")  # asked for: nothing to say
    assert capsys.readouterr().err.count("stopped at 1024 new tokens, the default bound") == 1


@pytest.mark.real
def test_the_readme_python_example_runs_as_written(tmp_path):
    """The README's Python block, run as it stands in an interpreter of its own, as a user runs it (the
    default models under a 1 GiB budget; the budget holds the calling process, so not pytest's)."""
    import re
    import subprocess
    import sys
    import time
    from pathlib import Path

    from shm.watchdog import REPO_ROOT

    readme = Path(REPO_ROOT, "README.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "cadence.LLM" in b)
    before = shm_segments()
    p = subprocess.run([sys.executable, "-c", block], cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    deadline = time.monotonic() + 15  # on a loaded host the last actors may still be leaving (test_nothing_lost.py)
    while time.monotonic() < deadline and not shm_segments() <= before:
        time.sleep(0.2)
    assert len(p.stdout.strip().splitlines()) >= 2 and shm_segments() <= before, shm_segments() - before


def test_a_prompts_log_probabilities_resident_and_streamed(tiny_gguf):
    """`prompt_logprobs`: each prompt token's log-probability under the target given what comes before it (the
    first's None), the same whether the layers are resident or streamed through the loader, alone or in a batch."""
    text = "the cat sat on the mat and then it ran away"
    got = {}
    for budget, parallel in ((None, 1), ("auto", 1), ("auto", 2)):
        opts = dict(target=str(tiny_gguf), mode="std" if budget else "target", no_trace=True, parallel=parallel)
        with cadence.LLM(**opts, **({"memory_budget": budget} if budget else {})) as llm:
            c = llm.generate([text] * parallel, max_new_tokens=2, logprobs=1, prompt_logprobs=True)[0]
            got[budget, parallel] = c.stats["prompt_logprobs"]
            assert len(got[budget, parallel]) == c.prompt_tokens and got[budget, parallel][0] is None
    first = [e[1] for e in got[None, 1][1:]]
    assert all(x <= 0 for x in first)
    for key, lp in got.items():
        assert [e[1] for e in lp[1:]] == pytest.approx(first, abs=1e-4), key
