"""Several generations at once over the actors (`cadence.LLM(parallel=4)`, speculative/batch.py) on a tiny model
under a memory budget: prompts join at random cycles, some leave halfway (a client gone), one samples; every
greedy generation that ran to its end is token for token its run alone, none is lost, and closing leaves no
shared memory behind."""

from __future__ import annotations

import random

import pytest

import cadence
from common.settings import SamplingConfig
from engine.prompts import Prompt
from tests.conftest import shm_segments

TEXTS = ["once upon a time", "the cat sat on", "in the beginning", "def main():", "1, 2, 3,", "hello there"]


@pytest.mark.parametrize("budget", [None, "auto"])
def test_generations_join_and_leave_at_random_cycles_and_each_is_its_own_run(tiny_gguf, budget):
    before = shm_segments()
    opts = dict(target=str(tiny_gguf), draft=str(tiny_gguf), parallel=4, no_trace=True)
    with cadence.LLM(**opts, **({"memory_budget": budget} if budget else {})) as llm:
        alone = {t: llm.generate(t, max_new_tokens=20).token_ids for t in TEXTS}
        r = llm.runner
        batch = r.batch()
        rng = random.Random(5)
        todo = [(i, rng.choice(TEXTS), i % 4 == 1, i == 6) for i in range(18)]
        live, done, left, most = {}, {}, set(), 0
        while todo or live:
            while todo and batch.free and rng.random() < 0.6:  # a request arrives between cycles, or not yet
                i, text, leaves, sampled = todo.pop(0)
                sampling = SamplingConfig(temperature=0.9, seed=i) if sampled else None
                r.join(i, Prompt(f"p{i}", "complete", text, chat=False), None, 20, sampling)
                live[i] = (text, leaves, sampled, 0)
            most = max(most, batch.active)
            for key, outcome in batch.cycle():
                chunk = r.chunk(key, outcome)
                assert not isinstance(chunk, Exception), chunk
                text, leaves, sampled, n = live[key]
                n += len(chunk.tokens)
                if chunk.completion is not None:
                    done[key] = (text, sampled, chunk.completion.token_ids)
                    del live[key]
                elif leaves and n > 1:  # the client went away: the slot is free at once
                    r.leave(key)
                    left.add(key)
                    del live[key]
                else:
                    live[key] = (text, leaves, sampled, n)
        assert most > 1 and left and batch.active == 0
        assert sorted([*done, *left]) == list(range(18))  # none lost
        for key, (text, sampled, ids) in done.items():  # a sampled one's seed gives it the text it gets alone
            want = llm.generate(text, max_new_tokens=20, temperature=0.9, seed=key) if sampled else None
            assert ids == (want.token_ids if sampled else alone[text]), key
    assert not (shm_segments() - before)


@pytest.mark.real
def test_a_batch_s_reads_are_taken_by_the_run_not_lost_between_its_rows():
    """The real pair at 768 MiB (the target streams), two generations at once: the batch's loads are no one
    generation's, its rows leave them out, and `Runner.take_io` (what a server's /metrics adds each cycle) has
    them."""
    from engine.config import RunConfig
    from engine.runner import Runner

    cfg = RunConfig.from_options(memory_budget="768MiB", parallel=2, max_new_tokens=6, no_trace=True)
    with Runner(cfg) as runner:
        assert runner.plan.memory.streamed
        prompts = [Prompt(f"p{i}", "complete", t) for i, t in enumerate(TEXTS[:2])]
        done = [c.completion for _, c in runner.stream_many(prompts) if getattr(c, "completion", None)]
        io = runner.take_io()
    assert len(done) == 2 and not any(c.stats.get("bytes_read") for c in done)
    assert io["bytes_read"] > 0 and io["loads"] > 0 and io["read_s"] > 0, io
