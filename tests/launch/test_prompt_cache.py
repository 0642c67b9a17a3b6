"""The prompt cache over the actors (speculative/prefixes.py in the verifier, issue 57 item 3): four conversations
sharing a system prompt take turns over two slots (`cadence.LLM(parallel=2)`), two at a time; each next turn finds
its conversation in the cache although the other two took both slots since, resident (in memory) and under a
budget (on disk), and every answer is the one a run with no cache gives."""

from __future__ import annotations

import pytest

import cadence
from engine.prompts import Prompt
from tests.conftest import shm_segments

SYSTEM = "You are a careful assistant. Answer in one short sentence, and never repeat the question back. " * 3
ASKS = ["what is a mutex?", "name a prime number", "why is the sky blue?", "how do bees fly?"]
NEW = 6


def _turns(llm, turns: int = 3) -> list[tuple[tuple, list[int], int, int]]:
    """Each turn, conversations 0 and 1 together, then 2 and 3: (messages, answer ids, prompt tokens, reused)."""
    convs = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": a}] for a in ASKS]
    out = []
    for turn in range(turns):
        for pair in ((0, 1), (2, 3)):
            prompts = [Prompt(f"c{i}-{turn}", "chat", "", messages=tuple(convs[i])) for i in pair]
            done = {}
            for p, chunk in llm.runner.stream_many(prompts, None, NEW):
                assert not isinstance(chunk, Exception), chunk
                if chunk.completion is not None:
                    done[p.id] = chunk.completion
            for i, p in zip(pair, prompts):
                c = done[p.id]
                out.append((turn, tuple(convs[i]), c.token_ids, c.prompt_tokens, c.stats["reused_prompt_tokens"]))
                convs[i] = convs[i] + [{"role": "assistant", "content": c.text}, {"role": "user", "content": "go on"}]
    return out


@pytest.mark.parametrize("budget", [None, "auto"])
def test_four_conversations_over_two_slots_find_their_prefixes_in_the_prompt_cache(tiny_gguf, budget, tmp_path):
    before = shm_segments()
    opts = dict(target=str(tiny_gguf), draft=str(tiny_gguf), no_trace=True, parallel=2)
    if budget:
        opts.update(memory_budget=budget, prompt_cache=str(tmp_path / "pc"))
    with cadence.LLM(**opts) as llm:
        pc = llm.plan.prompt_cache
        assert pc is not None and (pc.dir is not None) == bool(budget) and (pc.ram_bytes > 0) != bool(budget)
        if budget:  # the plan counts the cache's memory: none under a budget
            assert llm.plan.memory.overheads.prompt_cache == 0
        cached = _turns(llm)
    with cadence.LLM(**{**opts, "prompt_cache": "off"}) as llm:
        assert llm.plan.prompt_cache is None
        bare = _turns(llm)
    last = {}  # a conversation's last prompt tokens
    for (turn, msgs, ids, n, reused), (_, bmsgs, bids, _, breused) in zip(cached, bare):
        assert (msgs, ids) == (bmsgs, bids), turn  # the same conversations, the same answers
        if turn:  # its last turn's prompt was cached (a random model's answer may not encode back to its tokens)
            assert reused >= last[msgs[1]["content"]] - 1 and reused > breused, (turn, n, reused, breused)
        last[msgs[1]["content"]] = n
    if budget:
        assert list((tmp_path / "pc").rglob("*.kv"))  # the entries went to disk
    assert not (shm_segments() - before)


def test_a_conversation_longer_than_a_slots_share_keeps_its_prefix(tiny_gguf, tmp_path):
    """Four slots sharing a pool of four shares of 64 tokens under a budget: a conversation past a share needs a
    wider range of the pool each turn, so its slot's last range is not kept; its rows come back from the prompt cache
    instead of a prefill of the whole conversation (issue 56: time to first token 9.7 -> 12.8 -> 17.0 s over three
    turns, before)."""
    opts = dict(target=str(tiny_gguf), draft=str(tiny_gguf), no_trace=True, parallel=4, context=64)
    conv = [{"role": "user", "content": "the cat sat on the mat and then"}]
    with cadence.LLM(**opts, memory_budget="auto", prompt_cache=str(tmp_path / "pc")) as llm:
        last = 0
        for turn in range(4):
            [(_, chunk)] = [
                x
                for x in llm.runner.stream_many([Prompt(f"t{turn}", "chat", "", messages=tuple(conv))], None, NEW)
                if x[1].completion
            ]
            c = chunk.completion
            if turn:
                assert c.stats["reused_prompt_tokens"] >= last - 1, (turn, c.prompt_tokens, last)
            last = c.prompt_tokens
            conv = conv + [{"role": "assistant", "content": c.text}, {"role": "user", "content": "go on " * 6}]
        assert last > 64 + NEW  # past a share
