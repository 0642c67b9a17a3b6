"""What a request holds its output to (speculative/grammar.py): OpenAI's `response_format` (json_object, json_schema),
llama-server's `json_schema` (a schema) and `grammar` (a GBNF or Lark text). A client's text is never read as a
path (`files=False`): it names no file of the server's."""

from __future__ import annotations

import json

from common.errors import CadenceError, PromptError
from speculative.grammar import grammar_of, json_grammar

GRAMMARS = ("response_format", "json_schema", "grammar")


def read_grammar(body: dict) -> str:
    """The grammar the request holds its output to ("" for none; one of `GRAMMARS` at most); a `PromptError` naming
    the parameter at fault."""
    given = [k for k in GRAMMARS if body.get(k) is not None and not (k == "response_format" and _plain(body[k]))]
    if len(given) > 1:
        raise PromptError(f"{given[0]} and {given[1]} both hold the output to a grammar; give one", given[1])
    if not given:
        return ""
    key, v = given[0], body[given[0]]
    try:
        if key == "response_format":
            return _response_format(v)
        if key == "json_schema":
            if not isinstance(v, dict):
                raise PromptError(f"json_schema={_shown(v)} must be an object (a JSON schema)", key)
            return grammar_of(v, files=False)
        if not isinstance(v, str) or not v.strip():
            raise PromptError(f"grammar={_shown(v)} must be a GBNF or Lark grammar's text", key)
        return grammar_of(v, files=False)
    except PromptError:
        raise
    except CadenceError as e:
        raise PromptError(str(e), key) from None


def _plain(v) -> bool:
    return isinstance(v, dict) and v.get("type", "text") == "text"


def _response_format(v) -> str:
    """OpenAI's `response_format`: {"type": "json_object"} (any JSON object) or {"type": "json_schema",
    "json_schema": {"name", "schema", "strict"}} (the schema's JSON)."""
    key = "response_format"
    kind = v.get("type") if isinstance(v, dict) else None
    if kind == "json_object":
        return json_grammar(None)
    if kind != "json_schema":
        raise PromptError(f"{key}={_shown(v)} must have type text, json_object or json_schema", key)
    spec = v.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise PromptError(f'{key}.json_schema must be an object with a "schema" object', f"{key}.json_schema")
    return grammar_of(spec["schema"], files=False) if spec.get("schema") else json_grammar(None)


def _shown(v) -> str:
    text = json.dumps(v, ensure_ascii=True)
    return text if len(text) <= 40 else text[:37] + "..."


def forced_call_grammar(fmt, ask, tools) -> str:
    """The grammar a forced tool call (`tool_choice` required or a function) is held to: its function's parameters
    (engine/tools.py `call_grammar`); a 400 naming `tools` where a schema there does not compile."""
    from engine.tools import call_grammar

    try:
        return grammar_of(call_grammar(fmt, ask.tool_choice, tools, ask.parallel_tool_calls), files=False)
    except CadenceError as e:
        raise PromptError(f"a tool's parameters: {e}", "tools") from None
