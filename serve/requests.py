"""What a client asks for, read and checked before it reaches the model: one `ClientError` (status,
one sentence, the parameter at fault, in OpenAI's error shape) for anything a client got wrong, so the
server answers 4xx for the client's mistakes and keeps 500 for its own."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from common.errors import PromptError
from engine.prompts import Prompt
from serve import logprobs
from serve.structured import GRAMMARS, read_grammar

MAX_STOPS = 4  # OpenAI takes up to four stop strings
MAX_MESSAGES = 4096


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _integer(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# every other parameter of OpenAI's completions and chat completions (and the sampling ones llama.cpp's clients
# send): (what its value must be, in words; a check of it; when a value asks for what this server does not do).
# A value of the wrong kind, or one this server cannot honour, is a 400 that names the parameter; a parameter
# not in any table is refused as unknown, as OpenAI does, never ignored.
OTHERS = {
    "logit_bias": ("an object", lambda v: isinstance(v, dict), bool),
    "suffix": ("a string", lambda v: isinstance(v, str), bool),
    "best_of": ("an integer", _integer, lambda v: v != 1),
    "modalities": ("a list", lambda v: isinstance(v, list), lambda v: v != ["text"]),
    "audio": ("an object", lambda v: isinstance(v, dict), lambda v: True),
    "prediction": ("an object", lambda v: isinstance(v, dict), lambda v: True),
    "reasoning_effort": ("a string", lambda v: isinstance(v, str), lambda v: True),
    "web_search_options": ("an object", lambda v: isinstance(v, dict), lambda v: True),
    "store": ("true or false", lambda v: isinstance(v, bool), bool),
    "metadata": ("an object", lambda v: isinstance(v, dict), lambda v: False),
    "user": ("a string", lambda v: isinstance(v, str), lambda v: False),
    "service_tier": ("a string", lambda v: isinstance(v, str), lambda v: False),
    # llama-server's own: harmless ones accepted (the prompt cache is always on, the slot is the server's choice,
    # `samplers` names controls applied here in one order: penalties, temperature, top_k, top_p, min_p); the rest
    # accepted at the values that turn them off
    "cache_prompt": ("true or false", lambda v: isinstance(v, bool), lambda v: False),
    "id_slot": ("an integer", _integer, lambda v: False),
    "samplers": ("a list or a string", lambda v: isinstance(v, (list, str)), lambda v: False),
    "n_keep": ("an integer", _integer, lambda v: False),
    "min_keep": ("an integer", _integer, lambda v: False),
    "penalize_nl": ("true or false", lambda v: isinstance(v, bool), lambda v: False),
    "timings_per_token": ("true or false", lambda v: isinstance(v, bool), bool),
    "return_tokens": ("true or false", lambda v: isinstance(v, bool), bool),
    "post_sampling_probs": ("true or false", lambda v: isinstance(v, bool), bool),
    "n_probs": ("an integer", _integer, bool),
    "typical_p": ("a number", _number, lambda v: v != 1),
    "tfs_z": ("a number", _number, lambda v: v != 1),
    "mirostat": ("an integer", _integer, bool),
    "mirostat_tau": ("a number", _number, lambda v: False),
    "mirostat_eta": ("a number", _number, lambda v: False),
    "dynatemp_range": ("a number", _number, bool),
    "dynatemp_exponent": ("a number", _number, lambda v: False),
    "xtc_probability": ("a number", _number, bool),
    "xtc_threshold": ("a number", _number, lambda v: False),
    "dry_multiplier": ("a number", _number, bool),
    "dry_base": ("a number", _number, lambda v: False),
    "dry_allowed_length": ("an integer", _integer, lambda v: False),
    "dry_penalty_last_n": ("an integer", _integer, lambda v: False),
    "dry_sequence_breakers": ("a list", lambda v: isinstance(v, list), lambda v: False),
    "ignore_eos": ("true or false", lambda v: isinstance(v, bool), bool),
    "t_max_predict_ms": ("an integer", _integer, bool),
    "lora": ("a list", lambda v: isinstance(v, list), bool),
    "response_fields": ("a list", lambda v: isinstance(v, list), bool),
}
# the sampling controls (common/settings.py `SamplingConfig`): a request's name -> (the field, integer or not, the
# rule, the rule in words); llama-server's spellings too
CONTROLS = {
    "temperature": ("temperature", False, lambda v: 0 <= v <= 100, "a number of at least 0 (0: greedy)"),
    "top_p": ("top_p", False, lambda v: 0 < v <= 1, "a number in (0, 1]"),
    "top_k": ("top_k", True, lambda v: True, "an integer (0 or less: every token)"),
    "min_p": ("min_p", False, lambda v: 0 <= v <= 1, "a number in [0, 1]"),
    "presence_penalty": ("presence_penalty", False, lambda v: -2 <= v <= 2, "a number in [-2, 2]"),
    "frequency_penalty": ("frequency_penalty", False, lambda v: -2 <= v <= 2, "a number in [-2, 2]"),
    "repetition_penalty": ("repetition_penalty", False, lambda v: v > 0, "a number above 0 (1: none)"),
    "repeat_penalty": ("repetition_penalty", False, lambda v: v > 0, "a number above 0 (1: none)"),
    "repeat_last_n": ("repeat_last_n", True, lambda v: v >= -1, "an integer of at least -1 (-1: the whole text)"),
}
# the parameters read where the request is (read_ask and the functions it calls)
READ = {
    "model",
    "n",
    "stream",
    "stream_options",
    "max_tokens",
    "max_completion_tokens",
    "n_predict",
    "seed",
    "stop",
    *CONTROLS,
    *GRAMMARS,
    "logprobs",
    "top_logprobs",
}
ONLY = {  # chat's, completions'
    "messages": True,
    "prompt": False,
    "tools": True,
    "tool_choice": True,
    "parallel_tool_calls": True,
    "functions": True,
    "function_call": True,
    "echo": False,
}


class ClientError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


@dataclass(frozen=True)
class Ask:
    """One generation request, checked: the prompt and how to generate it."""

    chat: bool
    prompt: Prompt
    max_new_tokens: int | None = None
    sampling: dict = field(default_factory=dict)  # the sampling controls and seed the request gave (`CONTROLS`)
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    tool_choice: object = "auto"  # with tools (in `prompt.tools`): "auto", "none", "required" or a function's name
    parallel_tool_calls: bool = True
    calls: object = None  # the format its answer's tool calls are read in (engine/tools.py `Format`; None: none)
    echo: bool = False  # a completion's prompt comes back before its answer
    scored: bool = False  # max_tokens 0 with echo: the prompt scored, nothing generated (the token made is dropped)


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise ClientError(400, "the body must be a JSON object (UTF-8)") from None
    if not isinstance(body, dict):
        raise ClientError(400, "the body must be a JSON object")
    return body


def read_ask(body: dict, chat: bool, rid: str, models: set[str]) -> Ask:
    """The request's prompt and settings; ClientError for anything a model cannot do."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ClientError(400, "model must be a string", "model")
    if model is not None and model not in models:
        raise ClientError(
            404,
            f"the model {model!r} is not served here; GET /v1/models lists the one that is",
            "model",
            "not_found_error",
        )
    _check_others(body, chat)
    if body.get("n", 1) not in (1, None):  # serve/choices.py makes one body a choice
        raise ClientError(400, "n must be 1 here: one choice per generation", "n")
    tools, choice = _tools(body) if chat else ((), "auto")
    prompt = (
        Prompt(rid, "chat", "", chat=True, messages=tuple(_messages(body)), tools=tuple(tools))
        if chat
        else _completion_prompt(rid, body)
    )
    echo = False if chat else _asked(body, chat, logprobs.echoed)
    scored = echo and body.get("max_tokens") == 0
    if scored and _flag(body, "stream"):
        raise ClientError(
            400, "max_tokens 0 (the prompt scored, nothing generated) is answered whole; drop stream", "stream"
        )
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise ClientError(400, "stream_options must be an object", "stream_options")
    return Ask(
        chat,
        prompt,
        1 if scored else _max_tokens(body, chat),
        _sampling(body) | _asked(body, chat),
        _stops(body.get("stop")),
        _flag(body, "stream"),
        bool((opts or {}).get("include_usage")),
        choice,
        body.get("parallel_tool_calls") is not False,
        echo=echo,
        scored=scored,
    )


def _tools(body: dict) -> tuple[list[dict], object]:
    """The request's tools (`functions`, the older spelling, read as tools) and its choice among them."""
    from common.errors import CadenceError
    from engine.tools import check_tools

    key = "tools" if body.get("tools") is not None else "functions"
    tools = body.get(key)
    choice = body.get("tool_choice", body.get("function_call"))
    if key == "functions" and tools is not None:
        tools = [{"type": "function", "function": f} for f in tools] if isinstance(tools, list) else tools
        choice = {"type": "function", "function": choice} if isinstance(choice, dict) else choice
    if body.get("parallel_tool_calls") not in (None, True, False):
        raise ClientError(400, "parallel_tool_calls must be true or false", "parallel_tool_calls")
    if tools is None:
        if choice not in (None, "none", "auto"):
            raise ClientError(400, "tool_choice asks for a tool, but the request gives no tools", "tool_choice")
        return [], "auto"
    try:
        return check_tools(tools, choice, key)
    except CadenceError as e:
        raise ClientError(400, str(e), "tool_choice" if str(e).startswith("tool_choice") else key) from None


def _check_others(body: dict, chat: bool) -> None:
    """Every parameter besides those `read_ask` reads: of its kind, and asking for nothing this server does not
    do; a parameter no table knows is unknown."""
    for key, v in body.items():
        if key in READ or ONLY.get(key) == chat or v is None:
            continue
        if key not in OTHERS:
            where = "chat completions" if chat else "completions"
            wrong = (
                f" (it is a parameter of {'chat completions' if ONLY[key] else 'completions'})" if key in ONLY else ""
            )
            raise ClientError(400, f"{key} is not a parameter of {where}{wrong}; leave it out", key)
        kind, ok, asks = OTHERS[key]
        if not ok(v):
            raise ClientError(400, f"{key}={_shown(v)} must be {kind}", key)
        if asks(v):
            raise ClientError(400, f"{key}={_shown(v)} is not supported by this server; leave it out", key)


def _shown(v) -> str:
    text = json.dumps(v, ensure_ascii=True)
    return text if len(text) <= 40 else text[:37] + "..."


def _messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ClientError(400, 'messages must be a non-empty list of {"role", "content"} objects', "messages")
    if len(msgs) > MAX_MESSAGES:
        raise ClientError(400, f"{len(msgs)} messages are more than {MAX_MESSAGES}; send fewer", "messages")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ClientError(400, f'{where} must be an object with a "role" string', where)
        if m["role"] not in ("system", "user", "assistant", "developer", "tool"):
            raise ClientError(
                400, f"{where}.role {m['role']!r} must be system, user, assistant, developer or tool", f"{where}.role"
            )
        out.append(_message(m, where))
    return out


def _message(m: dict, where: str) -> dict:
    """One message for the template: its role and text; an assistant's tool calls (its content may then be null);
    a tool's answer with the id of the call it answers."""
    role = "system" if m["role"] == "developer" else m["role"]
    calls = m.get("tool_calls") if role == "assistant" else None
    if calls is not None and (not isinstance(calls, list) or not all(_a_call(c) for c in calls)):
        raise ClientError(
            400,
            f'{where}.tool_calls must be a list of {{"id", "type": "function", "function": {{"name", "arguments"}}}}',
            f"{where}.tool_calls",
        )
    content = m.get("content")
    out = {"role": role, "content": "" if content is None and calls else _content(content, f"{where}.content")}
    if calls:
        out["tool_calls"] = calls
    if role == "tool":
        if not isinstance(m.get("tool_call_id", ""), str):
            raise ClientError(400, f"{where}.tool_call_id must be a string", f"{where}.tool_call_id")
        out["tool_call_id"] = m.get("tool_call_id", "")
        out |= {"name": m["name"]} if isinstance(m.get("name"), str) else {}
    return out


def _a_call(c) -> bool:
    f = c.get("function") if isinstance(c, dict) else None
    return isinstance(f, dict) and isinstance(f.get("name"), str) and isinstance(f.get("arguments", ""), (str, dict))


def _content(content, where: str) -> str:
    """A message's text: a string, or a list of parts of type text (the form multimodal clients send)."""
    if isinstance(content, str):
        return _text(content, where)
    if isinstance(content, list) and content:
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ClientError(
                    400, f"{where}[{j}] is a {kind!r} part; this model reads parts of type text only", f"{where}[{j}]"
                )
            texts.append(_text(part["text"], f"{where}[{j}].text"))
        return "".join(texts)
    raise ClientError(400, f"{where} must be a string or a list of text parts", where)


def _text(s: str, where: str) -> str:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise ClientError(
            400, f"{where} is not valid text (it holds a lone surrogate); send UTF-8 text", where
        ) from None
    return s


def _completion_prompt(rid: str, body: dict) -> Prompt:
    """A completion's prompt: its text, or its token ids (a list of integers, as lm-evaluation-harness sends), or a
    list of one of those (a list of several: one body each, serve/choices.py)."""
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, list) and p and all(_integer(t) and t >= 0 for t in p):
        return Prompt(rid, "complete", "", chat=False, ids=tuple(p))
    if not isinstance(p, str):
        raise ClientError(400, "prompt must be a string, a list of token ids, or a list of those", "prompt")
    return Prompt(rid, "complete", _text(p, "prompt"), chat=False)


def _max_tokens(body: dict, chat: bool) -> int | None:
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    if body.get(key) is None and body.get("n_predict") is not None:  # llama-server's spelling (-1: no limit)
        key = "n_predict"
        if body[key] == -1:
            return None
    n = body.get(key)
    if n is None:
        return None
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ClientError(400, f"{key}={n!r} must be a positive integer", key)
    return n


def _sampling(body: dict) -> dict:
    """The sampling controls the request gives, by `SamplingConfig`'s names."""
    out = {}
    for key, (name, integral, ok, rule) in CONTROLS.items():
        v = body.get(key)
        if v is None:
            continue
        if not (_integer(v) if integral else _number(v)) or not ok(v):
            raise ClientError(400, f"{key}={_shown(v)} must be {rule}", key)
        out[name] = max(v, 0) if key == "top_k" else v if integral else float(v)
    seed = body.get("seed")
    if seed is not None:
        if not isinstance(seed, int) or isinstance(seed, bool) or not -(2**63) <= seed < 2**64:
            raise ClientError(400, f"seed={seed!r} must be an integer", "seed")
        out["seed"] = seed % (2**63)
    try:
        grammar = read_grammar(body)
    except PromptError as e:
        raise ClientError(400, str(e), e.param) from None
    return out | ({"grammar": grammar} if grammar else {})


def _asked(body: dict, chat: bool, read=logprobs.asked):
    """What serve/logprobs.py reads of the request (`read`: its log-probabilities, or its echo), a 400 where wrong."""
    try:
        return read(body, chat)
    except PromptError as e:
        raise ClientError(400, str(e), e.param) from None


def _stops(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) or len(stops) > MAX_STOPS:
        raise ClientError(400, f"stop must be a string or a list of at most {MAX_STOPS} strings", "stop")
    return tuple(_text(s, "stop") for s in stops if s)


def _flag(body: dict, key: str) -> bool:
    v = body.get(key, False)
    if not isinstance(v, bool) and v is not None:
        raise ClientError(400, f"{key} must be true or false", key)
    return bool(v)
