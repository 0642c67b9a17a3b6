"""`launch serve --parallel 4` under a memory budget, as many clients meet it: 32 streaming clients at once on a
tiny model, a third of them hanging up after their first piece and a quarter sampling. Every stream served to its
end closes with `[DONE]`, a greedy one's is the text the request gets alone, no request gets a 5xx, the cancelled ones free their slots, the
processes hold no more than the budget, and SIGTERM leaves no shared memory behind."""

from __future__ import annotations

import json
import random
import signal
import threading
import time

import pytest

from tests.conftest import shm_segments
from tests.launch.conftest import serve
from tests.launch.test_serve import KEY, _metric

httpx = pytest.importorskip("httpx")

PROMPTS = ["once upon a time", "the cat sat on", "in the beginning", "def main():", "1, 2, 3,", "hello there"]


@pytest.fixture(scope="module")
def server(tiny_gguf, tmp_path_factory):
    args = ["--target", str(tiny_gguf), "--draft", str(tiny_gguf), "--api-key", "sekret", "--parallel", "4"]
    args += ["--queue", "32", "--memory-budget", "auto", "--max-new-tokens", "24", "--no-trace", "--context", "64"]
    yield from serve(tmp_path_factory.mktemp("home"), args)


def _stream(base: str, prompt: str, hang_up: bool, temperature: float = 0.0, seed: int = 0) -> tuple[int, str, bool]:
    """(status, the streamed text, whether `[DONE]` closed it)."""
    text, done = "", False
    body = {"prompt": prompt, "max_tokens": 24, "temperature": temperature, "seed": seed, "stream": True}
    with httpx.stream("POST", f"{base}/v1/completions", headers=KEY, json=body, timeout=300) as r:
        if r.status_code != 200:
            return r.status_code, r.read().decode(), False
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            text += json.loads(data)["choices"][0]["text"]
            if hang_up and text:
                break
    return 200, text, done


def test_many_streaming_clients_with_disconnects_each_get_their_own_answer(server):
    base, _, _ = server
    alone = {}
    for prompt in PROMPTS:  # one at a time first: what each request gets alone
        r = httpx.post(
            f"{base}/v1/completions", headers=KEY, json={"prompt": prompt, "max_tokens": 24, "temperature": 0}
        )
        assert r.status_code == 200, r.text
        alone[prompt] = r.json()["choices"][0]["text"]
    cancelled = _metric(base, "cadence_requests_cancelled_total")
    rng = random.Random(3)
    jobs = [(rng.choice(PROMPTS), i % 3 == 0, 0.8 if i % 4 == 1 else 0.0, i) for i in range(32)]
    results: list = [None] * len(jobs)
    seen = []

    def client(i):
        results[i] = _stream(base, *jobs[i])

    def watch():  # generations under way, while the clients run
        while any(r is None for r in results):
            seen.append(_metric(base, "cadence_generating"))
            time.sleep(0.05)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    watcher = threading.Thread(target=watch)
    watcher.start()
    for t in threads:
        t.join()
    watcher.join()
    assert max(seen) > 1  # several generations at once
    for (prompt, hang_up, temperature, seed), (status, text, done) in zip(jobs, results):
        assert status == 200, text
        if not hang_up:
            assert done and (text == alone[prompt] if not temperature else text), prompt
        if temperature and not hang_up:  # a seed gives the same text beside others as alone
            body = {"prompt": prompt, "max_tokens": 24, "temperature": temperature, "seed": seed}
            r = httpx.post(f"{base}/v1/completions", headers=KEY, json=body, timeout=120)
            assert r.json()["choices"][0]["text"] == text, (prompt, seed)
    deadline = time.monotonic() + 30
    while _metric(base, "cadence_requests_cancelled_total") <= cancelled and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _metric(base, "cadence_requests_cancelled_total") > cancelled
    while _metric(base, "cadence_generating") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _metric(base, "cadence_generating") == 0  # every slot free again
    assert _metric(base, "cadence_memory_held_bytes") <= _metric(base, "cadence_memory_budget_bytes")
    metrics = httpx.get(f"{base}/metrics", headers=KEY).text
    assert "cadence_slots 4" in metrics


def test_a_prompt_longer_than_a_slots_share_is_served_from_the_kv_pool(server):
    """Each slot's share is 64 tokens; a prompt of more runs from the slots' KV pool (speculative/kvpool.py), beside
    short requests; one longer than the whole pool is a 400 that names the prompt."""
    base, _, _ = server
    long = "once upon a time " * 6
    results: dict = {}

    def ask(name, prompt):
        results[name] = httpx.post(
            f"{base}/v1/completions",
            headers=KEY,
            json={"prompt": prompt, "max_tokens": 24, "temperature": 0},
            timeout=300,
        )

    threads = [threading.Thread(target=ask, args=(i, p)) for i, p in enumerate(PROMPTS[:3])]
    threads.append(threading.Thread(target=ask, args=("long", long)))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r.status_code == 200 for r in results.values()), {k: r.text for k, r in results.items()}
    usage = results["long"].json()["usage"]
    assert usage["prompt_tokens"] > 64 and usage["completion_tokens"] > 0
    r = httpx.post(f"{base}/v1/completions", headers=KEY, json={"prompt": long * 8, "max_tokens": 24}, timeout=60)
    assert r.status_code == 400 and "prompt" in r.text, r.text


def _post(base: str, path: str, body: dict) -> dict:
    r = httpx.post(f"{base}{path}", headers=KEY, json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def _streamed(base: str, body: dict) -> tuple[dict[int, str], list[str]]:
    """A streamed request's text by choice index, and its data lines that were not chunks of a choice."""
    texts: dict[int, str] = {}
    others = []
    with httpx.stream("POST", f"{base}/v1/completions", headers=KEY, json=body | {"stream": True}, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data:"):
                data = line[5:].strip()
                chunk = None if data == "[DONE]" else json.loads(data)
                if chunk is None or not chunk["choices"]:
                    others.append(data)
                for c in chunk["choices"] if chunk else []:
                    texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    return texts, others


def test_a_list_of_prompts_and_n_choices_are_each_what_one_request_gets(server):
    """A completions `prompt` that is a list of prompts (texts and token ids), and `n` > 1: one generation a choice,
    side by side in the slots; greedy, choice i is prompt i's text alone; sampled with a seed, the first of a
    prompt's n is that prompt alone with the seed, the others differ, and the same request gives the same choices.
    Streamed, the chunks carry their choice's index and one [DONE] ends them; the usage is summed."""
    base, _, _ = server
    ids = [17, 4, 99, 12]
    prompts = [PROMPTS[0], PROMPTS[1], ids]
    alone = [_post(base, "/v1/completions", {"prompt": p, "max_tokens": 12, "temperature": 0}) for p in prompts]
    both = _post(base, "/v1/completions", {"prompt": prompts, "max_tokens": 12, "temperature": 0})
    assert [c["index"] for c in both["choices"]] == [0, 1, 2]
    assert [c["text"] for c in both["choices"]] == [a["choices"][0]["text"] for a in alone]
    for key in ("prompt_tokens", "completion_tokens"):
        assert both["usage"][key] == sum(a["usage"][key] for a in alone)
    texts, others = _streamed(
        base, {"prompt": prompts, "max_tokens": 12, "temperature": 0, "stream_options": {"include_usage": True}}
    )
    assert texts == {i: a["choices"][0]["text"] for i, a in enumerate(alone)}
    assert others[-1] == "[DONE]" and others.count("[DONE]") == 1
    assert json.loads(others[-2])["usage"] == both["usage"]

    sampled = {"max_tokens": 12, "temperature": 1.0, "seed": 5}
    alone = [_post(base, "/v1/completions", sampled | {"prompt": PROMPTS[2], "seed": s}) for s in (5, 6)]
    four = {"prompt": [PROMPTS[2], PROMPTS[3]], "n": 2}
    got = [c["text"] for c in _post(base, "/v1/completions", sampled | four)["choices"]]
    assert got[:2] == [a["choices"][0]["text"] for a in alone]  # prompt 0's two samples: seeds 5 and 6
    assert got[0] != got[1] and got[2] != got[3]
    assert [c["text"] for c in _post(base, "/v1/completions", sampled | four)["choices"]] == got
    chat = _post(base, "/v1/chat/completions", sampled | {"messages": [{"role": "user", "content": "hi"}], "n": 3})
    assert [c["index"] for c in chat["choices"]] == [0, 1, 2] and all(
        c["message"]["role"] == "assistant" for c in chat["choices"]
    )
    r = httpx.post(f"{base}/v1/completions", headers=KEY, json={"prompt": "x", "n": 33, "max_tokens": 2}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n" and "--queue" in r.text, r.text


def test_sigterm_with_parallel_slots_leaves_nothing(server):
    base, p, before = server
    p.send_signal(signal.SIGTERM)
    p.wait(timeout=30)
    err = p.stderr.read()
    assert p.returncode == 128 + signal.SIGTERM and "Traceback" not in err, err
    time.sleep(0.5)
    assert not [s for s in shm_segments() - before if s.startswith(f"cadence-{p.pid}x")]
