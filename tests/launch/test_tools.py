"""Tool calls (issue 57): an agent's loop with the official `openai` client against `launch serve` on the real
Qwen2.5-Coder-1.5B (its own chat template tells it of the tools): the model calls the tool with arguments that parse,
streamed or not alike, the tool's answer goes back, a final answer in words; a call forced by `tool_choice`; and each
family's format of calls read back out of an answer, whole or piece by piece (engine/tools.py)."""

from __future__ import annotations

import json

import pytest

from common import paths
from engine import tools
from tests.launch.conftest import serve
from bench.grammar import SCHEMAS

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
MODEL = "qwen2.5-coder-1.5b"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather like in Paris today? Use the tool."}]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """The real 1.5B, served from the machine's own store cache (converted once, as a user's is)."""
    args = ["--target", MODEL, "--draft", "none", "--max-new-tokens", "96", "--no-trace", "--context", "2048"]
    yield from serve(paths.home(), args, logs=tmp_path_factory.mktemp("logs"))


def _client(base):
    return openai.OpenAI(base_url=f"{base}/v1", api_key="-", max_retries=0, timeout=300)


@pytest.mark.real
def test_an_agent_loop_with_the_official_client(qwen):
    base, _, _ = qwen
    c = _client(base)
    r = c.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], temperature=0)
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and len(m.tool_calls) == 1, r
    call = m.tool_calls[0]
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and args["city"] == "Paris" and call.id.startswith("call_")
    # streamed: the same call, in delta.tool_calls chunks as OpenAI sends them
    got, finish = {}, None
    for ch in c.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], temperature=0, stream=True):
        d = ch.choices[0].delta if ch.choices else None
        for tc in (d.tool_calls if d else None) or []:
            entry = got.setdefault(tc.index, {"name": "", "arguments": ""})
            entry["name"] += tc.function.name or ""
            entry["arguments"] += tc.function.arguments or ""
        finish = (ch.choices[0].finish_reason if ch.choices else None) or finish
    assert finish == "tool_calls" and got == {0: {"name": "get_weather", "arguments": call.function.arguments}}
    # the tool's answer goes back; the model answers in words
    history = ASK + [m.model_dump(exclude_none=True)]
    history.append(
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "sky": "sunny"})}
    )
    r = c.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], tool_choice="none", temperature=0)
    final = r.choices[0]
    assert final.finish_reason == "stop" and not final.message.tool_calls, final
    assert "18" in final.message.content, final.message.content


@pytest.mark.real
def test_tool_choice_forces_a_call_and_a_named_function(qwen):
    base, _, _ = qwen
    c = _client(base)
    hello = [{"role": "user", "content": "Hello!"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = c.chat.completions.create(model=MODEL, messages=hello, tools=[WEATHER], tool_choice=named, temperature=0)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER["function"]["parameters"])
    r = c.chat.completions.create(model=MODEL, messages=hello, tools=[WEATHER], tool_choice="required", temperature=0)
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.tool_calls, r
    for call in r.choices[0].message.tool_calls:  # a forced call is held to its function's schema
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        bad = {"type": "function", "function": {"name": "nope"}}
        c.chat.completions.create(model=MODEL, messages=hello, tools=[WEATHER], tool_choice=bad)


@pytest.mark.real
def test_json_schema_answers_validate_with_the_official_client(qwen):
    """`response_format` json_schema over nested objects, arrays, enums, bounded numbers and optional fields: every
    answer parses and validates; streamed, the same text; json_object any object; llama-server's `json_schema` and
    `grammar` parameters; a schema that does not compile, a 400 naming the parameter."""
    base, _, _ = qwen
    c = _client(base)
    for name, (ask, schema) in SCHEMAS.items():
        fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
        msgs = [{"role": "user", "content": ask}]
        r = c.chat.completions.create(model=MODEL, messages=msgs, response_format=fmt, temperature=0, max_tokens=160)
        text = r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop", text
        jsonschema.validate(json.loads(text), schema)
    streamed = c.chat.completions.create(
        model=MODEL, messages=msgs, response_format=fmt, temperature=0, max_tokens=160, stream=True
    )
    assert "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices) == text
    r = c.chat.completions.create(model=MODEL, messages=msgs, response_format={"type": "json_object"}, max_tokens=160)
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = c.completions.create(
        model=MODEL, prompt="The answer, as JSON: ", max_tokens=24, extra_body={"grammar": 'root ::= "yes" | "no"'}
    )
    assert r.choices[0].text in ("yes", "no")
    r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=160, extra_body={"json_schema": schema})
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": 3}}}
    with pytest.raises(openai.BadRequestError, match="properties must be an object") as e:
        c.chat.completions.create(model=MODEL, messages=msgs, response_format=bad)
    assert e.value.body["param"] == "response_format"


def test_a_model_whose_template_takes_no_tools_is_a_400(tiny_gguf, tmp_path):
    import httpx

    for base, _, _ in serve(tmp_path, ["--target", str(tiny_gguf), "--max-new-tokens", "4", "--no-trace"]):
        r = httpx.post(f"{base}/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER]}, timeout=60)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "tools" and "does not take tools" in err["message"], r.text


CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
ANSWERS = [  # (format, an answer, the calls in it, its text outside them)
    ("hermes", f"Sure.\n<tool_call>\n{json.dumps(CALL)}\n</tool_call>", [CALL], "Sure.\n"),
    (
        "hermes",
        f"<tool_call>\n{json.dumps(CALL)}\n</tool_call>\n<tool_call>\n{json.dumps(CALL)}\n</tool_call>",
        [CALL] * 2,
        "\n",
    ),
    ("hermes", f"```json\n{json.dumps(CALL)}\n```", [CALL], ""),  # Qwen2.5-Coder's habit
    ("hermes", '{"name": "rm_rf", "arguments": {}}', [], '{"name": "rm_rf", "arguments": {}}'),  # not a tool: text
    ("hermes", "<tool_call>\nnot json\n</tool_call> ok", [], "<tool_call>\nnot json\n</tool_call> ok"),
    ("mistral", f"[TOOL_CALLS][{json.dumps(CALL)}, {json.dumps(CALL)}]", [CALL] * 2, ""),
    ("list", f"<|tool_call|>[{json.dumps(CALL)}]", [CALL], ""),
    ("llama3", json.dumps({"name": "get_weather", "parameters": {"city": "Paris"}}), [CALL], ""),
    ("llama3", "It is sunny in Paris.", [], "It is sunny in Paris."),
]


@pytest.mark.parametrize("fmt,answer,calls,text", ANSWERS)
def test_each_format_of_calls_is_read_whole_and_piece_by_piece(fmt, answer, calls, text):
    f = tools.FORMATS[fmt]
    content, got = tools.parse(answer, f, ["get_weather"])
    assert [{"name": c.name, "arguments": json.loads(c.arguments)} for c in got] == calls and content == text
    for cut in range(len(answer) + 1):  # streamed in two pieces, cut anywhere: the same events in the end
        stream = tools.CallStream(f, ["get_weather"])
        events = stream.push(answer[:cut]) + stream.push(answer[cut:]) + stream.finish()
        assert "".join(v for k, v in events if k == "text") == text
        assert [(c.name, c.arguments) for k, c in events if k == "call"] == [(c.name, c.arguments) for c in got]


def test_the_format_is_the_templates_and_a_forced_call_opens_it():
    assert tools.format_of("{% if tools %}<tool_call>{% endif %}").name == "hermes"
    assert tools.format_of("{{ '[TOOL_CALLS]' }}{{ tools }}").name == "mistral"
    assert tools.format_of("{{ messages }}") is None
    assert tools.forced_start(tools.FORMATS["hermes"], "f") == '<tool_call>\n{"name": "f", "arguments": '
    assert tools.forced_start(tools.FORMATS["llama3"], "required") == '{"name": "'


@pytest.mark.real
def test_the_python_api_takes_tools_too():
    import cadence

    with cadence.LLM(target=MODEL, draft="none", max_new_tokens=64, context=1024) as llm:
        done = llm.chat(ASK, tools=[WEATHER])
        assert done.finish_reason == "tool_calls" and [c.name for c in done.tool_calls] == ["get_weather"], done
        assert json.loads(done.tool_calls[0].arguments)["city"] == "Paris"
        forced = llm.chat([{"role": "user", "content": "Hello!"}], tools=[WEATHER], tool_choice="get_weather")
        assert forced.tool_calls and forced.tool_calls[0].name == "get_weather"
        assert not llm.chat(ASK, tools=[WEATHER], tool_choice="none").tool_calls
