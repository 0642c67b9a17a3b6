"""`launch serve` as a client meets it: the official `openai` client against a real server on a tiny
model (chat and completions, streamed and not), the queue's 429, a client that leaves mid-stream,
the API key, /health and /metrics, and SIGTERM stopping it all with nothing left behind."""

from __future__ import annotations

import copy

import os
import signal
import threading
import time

import pytest

from tests.conftest import shm_segments
from tests.launch.conftest import serve

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
KEY = {"Authorization": "Bearer sekret"}


@pytest.fixture(scope="module")
def server(tiny_gguf, tmp_path_factory):
    args = ["--target", str(tiny_gguf), "--dtype", "int4", "--draft", str(tiny_gguf), "--api-key", "sekret"]
    args += ["--queue", "1", "--max-new-tokens", "32", "--no-trace"]
    yield from serve(tmp_path_factory.mktemp("home"), args)


def _client(base, key="sekret"):
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=60)


def test_chat_completion_whole_and_streamed_give_the_same_text(server):
    base, _, _ = server
    c = _client(base)
    msgs = [{"role": "user", "content": "the cat sat on"}]
    whole = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=20, temperature=0)
    text = whole.choices[0].message.content
    assert whole.choices[0].message.role == "assistant" and whole.choices[0].finish_reason in ("stop", "length")
    assert whole.usage.completion_tokens > 0 and whole.usage.prompt_tokens > 0
    assert "<|im_end|>" not in text  # stop tokens are never part of the text
    pieces, finish = [], None
    for chunk in c.chat.completions.create(model="tiny", messages=msgs, max_tokens=20, temperature=0, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    assert "".join(pieces) == text and finish == whole.choices[0].finish_reason


def test_each_tokens_log_probabilities_in_both_shapes_and_the_target_alones(server, tiny_gguf):
    """`logprobs`/`top_logprobs` on chat, `logprobs: N` on completions: an entry per answer token (a stop token's
    left out), the chosen token the likeliest under greedy, the same text as without them, streamed whole in the last
    chunk; the tree's (the server's mode) are the target alone's, to the bit."""
    base, _, _ = server
    c = _client(base)
    msgs = [{"role": "user", "content": "count: one two"}]
    plain = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, temperature=0)
    r = c.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert r.choices[0].message.content == plain.choices[0].message.content
    assert len(content) == r.usage.completion_tokens - (r.choices[0].finish_reason == "stop") > 0
    for e in content:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob == e.logprob
        assert e.top_logprobs[0].token == e.token and e.bytes == list(e.token.encode())
    last = [
        ch
        for ch in c.chat.completions.create(
            model="tiny", messages=msgs, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3, stream=True
        )
        if ch.choices and ch.choices[0].finish_reason
    ][0]
    assert [e.logprob for e in last.choices[0].logprobs.content] == [e.logprob for e in content]
    got = c.completions.create(model="tiny", prompt="in the beginning", max_tokens=8, temperature=0, logprobs=2)
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) > 0
    assert all(len(t) <= 2 for t in lp.top_logprobs) and lp.text_offset[0] == 0
    import cadence

    with cadence.LLM(target=str(tiny_gguf), mode="target", dtype="int4") as llm:
        ref = llm.generate("in the beginning", max_new_tokens=8, logprobs=2)
    assert lp.token_logprobs == [e[1] for e in ref.stats["logprobs"] if e[0] not in llm.tokenizer.stop_ids]
    for body, param in (
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, **body)
        assert e.value.body["param"] == param
    with pytest.raises(openai.BadRequestError, match=r"logprobs=50 must be an integer in \[0, 20\]"):
        c.completions.create(model="tiny", prompt="x", max_tokens=4, logprobs=50)


def test_echo_scores_a_prompt_as_lm_evaluation_harness_asks(server, tiny_gguf):
    """`echo` with `logprobs` and max_tokens 0, the prompt as token ids (lm-evaluation-harness's loglikelihood
    request): each prompt token's log-probability under the target given what comes before it, the first None; a
    prompt that is the text and the greedy answer of an earlier request scores the answer's tokens as that request's
    own log-probabilities said."""
    import cadence

    with cadence.LLM(target=str(tiny_gguf), mode="target", dtype="int4") as llm:
        ids = llm.runner.tokenizer.encode("once upon a time there was")
        ref = llm.generate("once upon a time there was", max_new_tokens=4, logprobs=1)
    answer = [e[0] for e in ref.stats["logprobs"]]
    c = _client(base := server[0])
    got = c.completions.create(model="tiny", prompt=[ids + answer], max_tokens=0, echo=True, logprobs=1)
    lp, choice = got.choices[0].logprobs, got.choices[0]
    assert len(lp.token_logprobs) == len(ids) + len(answer) and got.usage.completion_tokens == 0
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and "".join(lp.tokens) == choice.text
    assert all(x <= 0 and len(t) == 1 for x, t in zip(lp.token_logprobs[1:], lp.top_logprobs[1:]))
    assert lp.token_logprobs[len(ids) :] == pytest.approx([e[1] for e in ref.stats["logprobs"]], abs=1e-4)
    more = c.completions.create(model="tiny", prompt="once upon a time there was", max_tokens=4, echo=True, logprobs=1)
    assert more.choices[0].text == "once upon a time there was" + ref.text
    assert len(more.choices[0].logprobs.token_logprobs) == len(ids) + len(ref.token_ids)
    streamed = "".join(
        ch.choices[0].text
        for ch in c.completions.create(
            model="tiny", prompt="once upon a time there was", max_tokens=4, echo=True, stream=True
        )
    )
    assert streamed == more.choices[0].text
    for body, says in (
        (dict(prompt=[10**9]), "outside the model's vocabulary"),
        (dict(prompt="x", max_tokens=0, echo=True, stream=True), "answered whole"),
        (dict(prompt="x", echo="yes"), "echo"),
    ):
        r = httpx.post(f"{base}/v1/completions", json={"model": "tiny", **body}, headers=KEY)
        assert r.status_code == 400 and says in r.json()["error"]["message"], (r.status_code, r.text[:300])
    r = httpx.post(
        f"{base}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "echo": True}, headers=KEY
    )
    assert r.status_code == 400 and "echo" in r.json()["error"]["message"]


def test_completions_match_the_python_api_token_for_token(server, tiny_gguf):
    base, _, _ = server
    c = _client(base)
    got = c.completions.create(model="tiny", prompt="in the beginning", max_tokens=16, temperature=0)
    streamed = "".join(
        ch.choices[0].text
        for ch in c.completions.create(
            model="tiny", prompt="in the beginning", max_tokens=16, temperature=0, stream=True
        )
    )
    import cadence

    with cadence.LLM(target=str(tiny_gguf), mode="target") as llm:  # the target alone: what every mode must equal
        ref = llm.generate("in the beginning", max_new_tokens=16)
    assert got.choices[0].text == streamed == ref.text
    assert got.usage.completion_tokens == len(ref.token_ids)


def test_models_health_and_metrics(server):
    base, _, _ = server
    ids = [m.id for m in _client(base).models.list()]
    assert len(ids) == 1 and ids[0].endswith("tiny.gguf")
    assert httpx.get(f"{base}/health").json()["status"] == "ok"
    assert httpx.get(f"{base}/metrics").status_code == 401  # behind the key when one is set
    text = httpx.get(f"{base}/metrics", headers=KEY).text
    for name in (
        "cadence_requests_total",
        "cadence_generated_tokens_total",
        "cadence_tokens_per_second",
        "cadence_accepted_per_verification",
        "cadence_disk_read_gbps",
        "cadence_queue_depth",
    ):
        assert f"\n{name} " in "\n" + text, name
    assert "# TYPE cadence_generated_tokens_total counter" in text
    c = _client(base)
    for _ in range(2):  # the second finds the first's prompt cached
        c.completions.create(model="tiny", prompt="a prompt sent twice, word for word", max_tokens=2, temperature=0)
    figures = {
        ln.split()[0]: float(ln.split()[1])
        for ln in httpx.get(f"{base}/metrics", headers=KEY).text.splitlines()
        if ln.startswith("cadence_prompt_tokens")
    }
    total, reused = figures["cadence_prompt_tokens_total"], figures["cadence_prompt_tokens_reused_total"]
    assert reused > 0 and reused + figures["cadence_prompt_tokens_prefilled_total"] == total


def test_an_api_key_is_required(server):
    base, _, _ = server
    with pytest.raises(openai.AuthenticationError):
        _client(base, key="wrong").models.list()
    r = httpx.post(f"{base}/v1/completions", json={"prompt": "x"})
    assert r.status_code == 401 and "API key" in r.json()["error"]["message"]


def test_bad_requests_get_one_sentence(server):
    base, _, _ = server
    h = {"Authorization": "Bearer sekret"}
    r = httpx.post(f"{base}/v1/chat/completions", json={"messages": "hi"}, headers=h)
    assert r.status_code == 400 and "messages must be" in r.json()["error"]["message"]
    r = httpx.post(f"{base}/v1/completions", json={"prompt": "x", "max_tokens": -3}, headers=h)
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
    r = httpx.post(f"{base}/v1/completions", content=b"not json", headers=h)
    assert r.status_code == 400


def test_a_full_queue_answers_429_and_every_accepted_request_completes(server):
    base, _, _ = server
    h = {"Authorization": "Bearer sekret"}
    codes, waits = [], []
    together = threading.Barrier(5)  # the five posted at once (a tiny model's 32 tokens outrun threads started apart)

    def ask():
        with httpx.Client(timeout=120) as client:
            client.get(f"{base}/health")  # (the connection made before the barrier)
            together.wait()
            r = client.post(
                f"{base}/v1/completions",
                json={"prompt": "once upon a time", "max_tokens": 400, "temperature": 0},
                headers=h,
            )
        codes.append(r.status_code)
        if r.status_code == 429:
            waits.append(r.headers.get("retry-after"))

    threads = [threading.Thread(target=ask) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert 429 in codes and 200 in codes and set(codes) <= {200, 429}, (
        codes
    )  # one running, one queued, the rest refused
    assert waits and all(w is not None and int(w) > 0 for w in waits), waits  # each refusal says when to retry


def test_serve_on_a_port_another_process_listens_on_says_so_before_loading(tiny_gguf, tmp_path):
    """A busy port is found before the models load (minutes, for a large one): one sentence, exit 2 (bad usage)."""
    import socket
    import subprocess
    import sys

    from common import paths

    env = dict(os.environ, CADENCE_HOME=str(tmp_path), CADENCE_KERNELS_DIR=str(paths.kernels_dir()))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cmd = [sys.executable, "-m", "launch.cli", "serve", "--target", str(tiny_gguf), "--port", str(port)]
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip() == (
        f"launch: port {port} on 127.0.0.1 is taken (Address already in use): another server listens there; "
        "stop it or give --port another"
    ), p.stderr
    assert not (tmp_path / "stores").exists()  # nothing was loaded or converted


def test_a_client_that_leaves_mid_stream_stops_its_generation(server):
    base, _, _ = server
    h = {"Authorization": "Bearer sekret"}
    before = _metric(base, "cadence_requests_cancelled_total")
    with httpx.stream(
        "POST",
        f"{base}/v1/completions",
        headers=h,
        timeout=60,
        json={"prompt": "once upon a time", "max_tokens": 400, "temperature": 0, "stream": True},
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data:") and "text" in line:
                break  # one chunk, then hang up
    deadline = time.monotonic() + 30
    while _metric(base, "cadence_requests_cancelled_total") <= before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _metric(base, "cadence_requests_cancelled_total") > before
    ok = _client(base).completions.create(model="tiny", prompt="next", max_tokens=4, temperature=0)  # served at once
    assert ok.choices[0].text is not None


def test_a_client_that_leaves_while_it_waits_gives_its_place_up_at_once_and_is_counted(server):
    """One request generating, one waiting (the queue holds one): the waiting client hangs up. Its place frees at
    once, so the next request waits instead of getting a 429, and it is counted as cancelled, not lost."""
    base, _, _ = server
    before = _metric(base, "cadence_requests_cancelled_total")
    long = {"prompt": "once upon a time", "max_tokens": 400, "temperature": 0}
    first = threading.Thread(target=lambda: httpx.post(f"{base}/v1/completions", json=long, headers=KEY, timeout=120))
    first.start()
    time.sleep(0.5)  # generating
    with httpx.stream("POST", f"{base}/v1/completions", headers=KEY, timeout=60, json={**long, "stream": True}) as r:
        assert r.status_code == 200  # waiting for the slot
    deadline = time.monotonic() + 10
    while _metric(base, "cadence_requests_cancelled_total") <= before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _metric(base, "cadence_requests_cancelled_total") == before + 1
    third = httpx.post(f"{base}/v1/completions", json={**long, "max_tokens": 4}, headers=KEY, timeout=120)
    assert third.status_code == 200, third.text  # waited for the slot the hung-up client gave up
    first.join()


def _metric(base: str, name: str) -> float:
    for line in httpx.get(f"{base}/metrics", headers=KEY).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} missing")


def _post(base, path, body=None, content=None, headers=KEY):
    """`body` as a client's JSON library writes it (\\uXXXX escapes: a lone surrogate gets through)."""
    import json as js

    content = js.dumps(body).encode() if body is not None else content
    return httpx.post(
        f"{base}{path}", content=content, headers={**headers, "Content-Type": "application/json"}, timeout=60
    )


@pytest.mark.parametrize(
    "path,body,status,param",
    [
        ("/v1/completions", {"prompt": "x", "temperature": -0.5}, 400, "temperature"),
        ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 10**9}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 1e9}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "the cat " * 400}, 400, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}] * 10_000}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "the cat " * 400}]}, 400, "messages"),
        ("/v1/completions", {"prompt": "x", "model": "gpt-4o"}, 404, "model"),
        ("/v1/completions", {"prompt": "x", "logprobs": True}, 400, "logprobs"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": 3}, 400, "logprobs"),
        ("/v1/completions", {"prompt": "x", "echo": 1}, 400, "echo"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            400,
            "messages[0].content[0]",
        ),
        ("/v1/completions", {"prompt": "a lone \ud800 surrogate"}, 400, "prompt"),
        ("/v1/completions", {"prompt": "x", "presence_penalty": "abc"}, 400, "presence_penalty"),
        ("/v1/completions", {"prompt": "x", "presence_penalty": 5}, 400, "presence_penalty"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_k": 1.5}, 400, "top_k"),
        ("/v1/completions", {"prompt": "x", "repeat_last_n": -2}, 400, "repeat_last_n"),
        ("/v1/completions", {"prompt": "x", "mirostat": 2}, 400, "mirostat"),
        ("/v1/completions", {"prompt": "x", "n_probs": 3}, 400, "n_probs"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": 3}},
            400,
            "logit_bias",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}},
            400,
            "response_format",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "json_schema": {}, "grammar": 'root ::= "a"'},
            400,
            "grammar",
        ),
        ("/v1/completions", {"prompt": "x", "grammar": "root ::= undefined_rule"}, 400, "grammar"),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "x"}],
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}},
            },
            400,
            "response_format.json_schema",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "f"}]},
            400,
            "tools",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "user": 7}, 400, "user"),
        ("/v1/completions", {"prompt": "x", "messages": []}, 400, "messages"),
        ("/v1/completions", {"prompt": "x", "temprature": 0.5}, 400, "temprature"),
    ],
)
def test_what_a_client_got_wrong_is_a_4xx_naming_the_parameter(server, path, body, status, param):
    base, _, _ = server
    r = _post(base, path, body)
    err = r.json()["error"]
    assert r.status_code == status and err["param"] == param and err["code"] == status, r.text
    assert err["message"] and "\n" not in err["message"] and "Traceback" not in err["message"]


def test_parameters_that_ask_for_nothing_are_honoured_as_they_are(server):
    """What a client library sends at its defaults (no penalty, no bias, text out, no tools, a user id) is a
    request like any other: the same tokens as the bare one."""
    base, _, _ = server
    bare = {"messages": [{"role": "user", "content": "count: one two"}], "max_tokens": 6, "temperature": 0}
    given = {
        **bare,
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
        "logit_bias": {},
        "logprobs": False,
        "response_format": {"type": "text"},
        "tool_choice": "none",
        "parallel_tool_calls": True,
        "user": "u-1",
        "metadata": {"k": "v"},
        "store": False,
        "top_k": 0,
        "min_p": 0,
        "repeat_penalty": 1.0,
        "n": 1,
        # llama-server's, at its web page's defaults
        "cache_prompt": True,
        "id_slot": -1,
        "samplers": ["penalties", "dry", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature"],
        "typical_p": 1,
        "mirostat": 0,
        "dry_multiplier": 0,
        "xtc_probability": 0,
        "dynatemp_range": 0,
        "n_probs": 0,
        "repeat_last_n": 64,
    }
    a, b = _post(base, "/v1/chat/completions", bare), _post(base, "/v1/chat/completions", given)
    assert a.status_code == b.status_code == 200, b.text
    assert a.json()["choices"][0]["message"] == b.json()["choices"][0]["message"]


def test_a_body_over_the_limit_is_refused_before_it_is_read(server):
    base, _, _ = server
    r = _post(base, "/v1/completions", content=b'{"prompt": "' + b"x" * (5 << 20) + b'"}')
    assert r.status_code == 413 and "--max-body" in r.json()["error"]["message"]


def test_content_given_as_text_parts_is_read_as_its_text(server):
    base, _, _ = server
    c = _client(base)
    plain = c.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "the cat sat"}], max_tokens=6, temperature=0
    )
    parts = c.chat.completions.create(
        model="tiny",
        temperature=0,
        max_tokens=6,
        messages=[{"role": "user", "content": [{"type": "text", "text": "the cat"}, {"type": "text", "text": " sat"}]}],
    )
    assert parts.choices[0].message.content == plain.choices[0].message.content


def _mutations(rng):
    """Bodies an OpenAI client might send, and those it should not: the fuzzer's material."""
    values = [
        None,
        True,
        False,
        0,
        1,
        -1,
        7,
        2.5,
        float("1e308"),
        10**20,
        "",
        "x",
        "8",
        [],
        [1],
        {},
        {"a": 1},
        "\ud800",
        "\u0000",
        [{"type": "text", "text": "hi"}],
        [{"role": "user", "content": "hi"}],
    ]
    keys = [
        "model",
        "prompt",
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "seed",
        "stop",
        "stream",
        "stream_options",
        "n",
        "logprobs",
        "echo",
        "content",
        "role",
        "best_of",
        "suffix",
        "user",
    ]
    chat = rng.random() < 0.5
    body = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    body["max_tokens"] = 4
    pick = lambda: copy.deepcopy(rng.choice(values))  # a copy: a list put inside itself would be circular
    for _ in range(rng.randint(0, 4)):
        body[rng.choice(keys)] = pick()
    if chat and rng.random() < 0.3 and isinstance(body.get("messages"), list) and body["messages"]:
        body["messages"][0] = {rng.choice(keys): pick(), "role": rng.choice(["user", "tool", 3, None])}
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


def test_fuzzed_requests_never_get_a_500_and_the_server_serves_on(server):
    """Random and mutated OpenAI bodies (seeded, at most 250 or 90 s), and raw bytes: a 4xx or a 200 each,
    never a 500 nor a traceback in the server's log; then a normal request is served."""
    import json as js
    import random

    base, proc, _ = server
    seed = int(os.environ.get("CADENCE_TEST_SEED", random.randrange(1 << 30)))
    print(f"fuzz seed {seed} (rerun with CADENCE_TEST_SEED={seed})")
    rng = random.Random(seed)
    deadline, seen = time.monotonic() + 90, {}
    for i in range(250):
        if time.monotonic() > deadline:
            break
        path, body = _mutations(rng)
        raw = (
            js.dumps(body).encode()
            if rng.random() < 0.9
            else bytes(rng.randrange(256) for _ in range(rng.randrange(64)))
        )
        r = _post(base, path, content=raw)
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert r.status_code < 500, (i, raw[:300], r.text[:300])
    assert seen.get(200, 0) > 0 and sum(v for k, v in seen.items() if 400 <= k < 500) > 0, seen
    ok = _client(base).completions.create(model="tiny", prompt="next", max_tokens=4, temperature=0)
    assert ok.choices[0].text is not None and proc.poll() is None


# -- the chat page at / --------------------------------------------------------------------------------


def _page_ready(browser, base):
    from selenium.webdriver.common.by import By

    browser.get(base + "/")
    browser.execute_script("localStorage.setItem('cadence-key', 'sekret')")  # as a user who typed it once
    browser.get(base + "/")
    assert browser.find_element(By.ID, "key").get_attribute("value") == "sekret"
    browser.get_log("browser")  # what the first visit, without the key, logged
    browser.execute_script(  # every change to the conversation's elements, counted
        "window.updates = 0; new MutationObserver((rs) => { window.updates += rs.length; })"
        ".observe(document.getElementById('messages'), {childList: true, subtree: true, characterData: true});"
    )


def _say(browser, text: str, max_tokens: int):
    from selenium.webdriver.common.by import By

    field = browser.find_element(By.ID, "max-tokens")
    field.clear()
    field.send_keys(str(max_tokens))
    temp = browser.find_element(By.ID, "temperature")
    temp.clear()
    temp.send_keys("0")
    browser.find_element(By.ID, "input").send_keys(text)
    browser.find_element(By.ID, "send").click()


def _wait(browser, what, timeout: float = 60):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(browser, timeout, poll_frequency=0.02).until(what)


def test_the_chat_page_streams_an_answer_draws_code_and_shows_the_live_figures(server, browser):
    """In a real headless Chromium: a message typed and sent, the answer streamed into the page (the same text
    the API gives), code fences drawn as code, the run's figures filled in from /metrics; nothing fetched from
    elsewhere."""
    import re

    from selenium.webdriver.common.by import By

    base, _, _ = server
    page = httpx.get(f"{base}/").text
    assert not re.search(r"https?://|<link\b|\bsrc\s*=|@import|url\(", page, re.I)  # nothing from elsewhere, ever
    _page_ready(browser, base)
    _say(browser, "count: one two", 12)
    _wait(browser, lambda d: d.find_element(By.ID, "state").text == "idle")
    said = browser.execute_script("return conversation")
    want = _client(base).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "count: one two"}], max_tokens=12, temperature=0
    )
    assert [m["role"] for m in said] == ["user", "assistant"] and said[1]["content"] == want.choices[0].message.content
    assert browser.execute_script("return window.updates") >= 3  # the bubbles, then the answer chunk by chunk
    drawn = browser.execute_script("return render('a `b` <i>\\n```py\\nx < 1\\n```')")
    assert drawn == '<p>a <code>b</code> &lt;i&gt;<br></p><pre><code data-lang="py">x &lt; 1\n</code></pre>'
    _wait(browser, lambda d: "MiB" in d.find_element(By.ID, "memory").text and d.find_element(By.ID, "tps").text != "-")
    errors = [m for m in browser.get_log("browser") if m["level"] == "SEVERE"]
    assert not errors, errors


def test_the_chat_page_stop_button_ends_the_generation_and_the_chat_goes_on(server, browser):
    from selenium.webdriver.common.by import By

    base, proc, _ = server
    _page_ready(browser, base)
    before = _metric(base, "cadence_requests_cancelled_total")
    for _ in range(3):  # a tiny model may end its answer before the click: ask again
        n = len(browser.find_elements(By.CSS_SELECTOR, ".msg.assistant"))
        _say(browser, "tell a long story about the sea", 400)
        _wait(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, ".msg.assistant")) > n)
        _wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant")[-1].text.strip() != "")
        browser.find_element(By.ID, "stop").click()
        _wait(browser, lambda d: d.find_element(By.ID, "state").text != "generating")
        if browser.find_element(By.ID, "state").text == "stopped":
            break
    assert browser.find_element(By.ID, "state").text == "stopped"
    assert "stopped" in browser.find_elements(By.CSS_SELECTOR, ".msg.assistant")[-1].text
    deadline = time.monotonic() + 15
    while _metric(base, "cadence_requests_cancelled_total") <= before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _metric(base, "cadence_requests_cancelled_total") > before  # the server stopped generating it
    _say(browser, "and now?", 6)  # the conversation goes on
    _wait(browser, lambda d: d.find_element(By.ID, "state").text == "idle")
    assert browser.execute_script("return conversation")[-1]["role"] == "assistant" and proc.poll() is None


# -- last: it stops the module's server ---------------------------------------------------------------


def test_sigterm_stops_the_server_and_leaves_nothing(server):
    base, p, before = server
    assert httpx.get(f"{base}/health").status_code == 200
    assert _post(base, "/v1/completions", {"prompt": "x", "max_tokens": -3}).status_code == 400
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}
    assert _post(base, "/v1/chat/completions", chat).status_code == 200
    p.send_signal(signal.SIGTERM)
    p.wait(timeout=30)
    err = p.stderr.read()
    assert p.returncode == 128 + signal.SIGTERM and "stopped by SIGTERM" in err and "Traceback" not in err, err
    assert "Exception" not in err, err  # nothing the fuzzer sent made the server log an error of its own
    # a line per request, as llama-server's and uvicorn's users read them: method, path, status, tokens, seconds
    import re

    lines = [ln for ln in err.splitlines() if re.fullmatch(r"(GET|POST) /\S* \d{3}( \d+ tokens)? \d+\.\d\d s", ln)]
    assert any(re.match(r"POST /v1/chat/completions 200 \d+ tokens", ln) for ln in lines), err[-3000:]
    assert any(ln.startswith(("POST /v1/completions 400 ", "POST /v1/chat/completions 400 ")) for ln in lines)
    assert any(ln.startswith("GET /health 200 ") for ln in lines)
    time.sleep(0.5)
    assert not [s for s in shm_segments() - before if s.startswith(f"cadence-{p.pid}x")]  # none of its own left
