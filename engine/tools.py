"""Tool calls, as OpenAI's API carries them (`tools`, `tool_choice`, `parallel_tool_calls`, `tool` messages,
assistant messages with `tool_calls`): a request's tools checked, the model's own chat template told of them, and
the model's answer read back into calls in its family's format:

- `hermes`: Qwen 2.5/3, Hermes, SmolLM3: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one
  block a call;
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`;
- `list`: Granite, Phi-4-mini: `<|tool_call|>[{"name": ..., "arguments": {...}}, ...]`;
- `llama3`: Llama 3.1-3.3: the answer a JSON object `{"name": ..., "parameters": {...}}` (after `<|python_tag|>` or
  alone); in any format, an answer that is only a call's JSON (or that JSON in a ```json fence) naming the request's
  tools.

A template that never reads `tools` cannot show a model its tools: such a request is refused (`no_tools`). A call is
forced (`tool_choice` "required", or a named function) by starting the answer with the format's opening (and the
name): the target continues from there, so its tokens are still its own. Answers stream: text goes out as it comes,
held back only while it may be the start of a call; a call goes out whole as soon as it closes (`CallStream`)."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from common.errors import CadenceError


@dataclass(frozen=True)
class Format:
    name: str
    start: str  # what opens a call (or the list of calls)
    end: str  # what closes it ("": the rest of the answer)
    args: str = "arguments"  # the key of a call's arguments
    many: bool = False  # the opening holds a JSON list of calls


FORMATS = {
    "hermes": Format("hermes", "<tool_call>", "</tool_call>"),
    "mistral": Format("mistral", "[TOOL_CALLS]", "", many=True),
    "list": Format("list", "<|tool_call|>", "", many=True),
    "llama3": Format("llama3", "<|python_tag|>", "", args="parameters"),
}


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as a string (OpenAI's `function.arguments`)

    def openai(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def format_of(template: str | None) -> Format | None:
    """The tool-call format a chat template teaches its model (None: the template never reads `tools`)."""
    if not template or "tools" not in template:
        return None
    for marker, name in (("<tool_call>", "hermes"), ("[TOOL_CALLS]", "mistral"), ("<|tool_call|>", "list")):
        if marker in template:
            return FORMATS[name]
    return FORMATS["llama3"] if "<|python_tag|>" in template or "parameters" in template else FORMATS["hermes"]


def names(tools) -> list[str]:
    """The functions' names of tools in OpenAI's form."""
    return [t["function"]["name"] for t in tools]


def no_tools(model: str) -> str:
    return (
        f"the model {model}'s chat template does not take tools, so it cannot be told of them; "
        "send the request without tools, or serve a model whose template takes them"
    )


def forced_start(fmt: Format, choice) -> str:
    """The opening of the answer that forces a call: `choice` "required" (any tool) or a function's name."""
    opening = {"hermes": "<tool_call>\n{", "mistral": "[TOOL_CALLS][{", "list": "<|tool_call|>[{", "llama3": "{"}
    start = opening[fmt.name] + '"name": "'
    if choice == "required":  # the model names the function (a grammar would hold it to the tools' names)
        return start
    return start + json.dumps(choice)[1:-1] + f'", "{fmt.args}": '


END = {"hermes": "\n</tool_call>", "mistral": "]", "list": "]", "llama3": ""}  # what closes a forced call


def call_grammar(fmt: Format, choice, tools, parallel: bool = True) -> str:
    """The grammar (Lark, for speculative/grammar.py) of what follows `forced_start(fmt, choice)`: the call's name among
    the tools' (`choice` "required") and its arguments valid under that function's `parameters` schema, then the
    call's close; with `parallel`, in the hermes format, more whole calls may follow. Nothing after them."""
    schemas = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in tools}
    chosen = list(schemas) if choice == "required" else [choice]
    lines, calls = [], []
    for i, name in enumerate(chosen):
        lines.append(f"args{i}: %json {json.dumps(schemas[name])}")
        calls.append(f"{json.dumps(json.dumps(name)[1:] + ', ' + json.dumps(fmt.args) + ': ')} args{i}")
    close = json.dumps("}" + END[fmt.name])
    named = f"call: ({' | '.join(calls)}) {close}"
    head = f"start: args0 {close}" if choice != "required" else "start: call"
    if parallel and fmt.name == "hermes":
        again = json.dumps('\n<tool_call>\n{"name": "')
        more = f"more: {again} call"
        return "\n".join([head + " more*", named, more, *lines])
    return "\n".join([head, named, *lines])


def for_template(messages: list[dict]) -> list[dict]:
    """Messages as chat templates expect them (transformers' convention): an assistant's `tool_calls` with their
    arguments as objects, not OpenAI's JSON strings (a template writes them with `tojson`)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            m = {**m, "tool_calls": [_call_for_template(c) for c in calls]}
        out.append(m)
    return out


def _call_for_template(c: dict) -> dict:
    f = dict(c.get("function") or {})
    if isinstance(f.get("arguments"), str):
        try:
            f["arguments"] = json.loads(f["arguments"])
        except json.JSONDecodeError:
            pass  # kept as the client wrote it
    return {**c, "function": f}


def _call(obj, fmt: Format) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(fmt.args, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(f"call_{uuid.uuid4().hex[:24]}", obj["name"], json.dumps(args, ensure_ascii=False))


def _calls(body: str, fmt: Format, whole: bool = False) -> list[ToolCall] | None:
    """The calls a call's text holds (None: it is not one): one JSON object, or a list of them (`whole`: and
    nothing after them)."""
    body = body.strip()
    try:
        obj, end = json.JSONDecoder().raw_decode(body)
    except json.JSONDecodeError:
        return None
    if whole and body[end:].strip():
        return None
    objs = obj if isinstance(obj, list) else [obj]
    calls = [_call(o, fmt) for o in objs]
    return calls if calls and all(calls) else None


def parse(text: str, fmt: Format, names=()) -> tuple[str, list[ToolCall]]:
    """(the answer's text outside its calls, the calls) of a whole answer (`names`: the request's tools)."""
    stream = CallStream(fmt, names)
    events = stream.push(text) + stream.finish()
    content = "".join(v for k, v in events if k == "text")
    return content, [v for k, v in events if k == "call"]


BARE = ("{", "```json")  # how an answer that is a bare call (JSON, or JSON in a fence) begins


class CallStream:
    """An answer's pieces in, ("text", str) and ("call", ToolCall) events out: text as soon as it cannot be the
    start of a call, a call as soon as it closes; a call that does not parse goes out as the text it was.

    Besides its format's markers, an answer that is nothing but a call's JSON (bare or in a ```json fence, as
    Qwen2.5-Coder often writes it, and Llama 3 always) is a call when every name in it is one of the request's
    tools (`names`): such an answer is held to its end."""

    def __init__(self, fmt: Format, names=()):
        self.fmt, self.names, self.buf, self.inside, self.started = fmt, set(names), "", False, False
        self.opener = ""  # what opened the call being read ("": a bare answer)
        self.bare = False

    def push(self, piece: str) -> list:
        self.buf += piece
        out = []
        while True:
            if self.bare:
                return out
            if not self.inside:
                if not self.started:
                    head = self.buf.lstrip()
                    if any(head.startswith(b) for b in BARE):
                        self.bare = True
                        return out
                    if not head or any(b.startswith(head) for b in BARE):
                        return out  # it may yet be one
                at = self.buf.find(self.fmt.start)
                if at < 0:
                    keep = _partial(self.buf, self.fmt.start)
                    text, self.buf = self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep :]
                    out += self._text(text)
                    return out
                out += self._text(self.buf[:at])
                self.buf, self.inside, self.opener = self.buf[at + len(self.fmt.start) :], True, self.fmt.start
                continue
            if not self.fmt.end:
                return out  # the rest of the answer is the call
            at = self.buf.find(self.fmt.end)
            if at < 0:
                return out
            out += self._close(self.buf[:at], self.opener + self.buf[: at + len(self.fmt.end)])
            self.buf, self.inside = self.buf[at + len(self.fmt.end) :], False

    def finish(self) -> list:
        """The events the answer's end lets out (a call left open at the end: the rest of the answer)."""
        buf, self.buf = self.buf, ""
        if self.bare:
            body = buf.strip().removeprefix("```json").removesuffix("```")
            calls = _calls(body, self.fmt, whole=True)
            if calls and all(c.name in self.names for c in calls):
                return [("call", c) for c in calls]
            return self._text(buf)
        if self.inside:
            return self._close(buf, self.opener + buf)
        return self._text(buf)

    def _text(self, text: str) -> list:
        if text.strip():
            self.started = True
        return [("text", text)] if text else []

    def _close(self, body: str, raw: str) -> list:
        self.started = True
        calls = _calls(body, self.fmt)
        return [("call", c) for c in calls] if calls else [("text", raw)]


def _partial(text: str, marker: str) -> int:
    """How many of text's last characters may begin `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def check_tools(tools, choice, where: str = "tools") -> tuple[list[dict], object]:
    """(the tools in OpenAI's form, the choice: "auto", "none", "required" or a function's name) of what a client
    sent; a CadenceError naming what is wrong."""
    if not isinstance(tools, list) or not tools:
        raise CadenceError(f'{where} must be a non-empty list of {{"type": "function", "function": {{...}}}} objects')
    names = []
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(f, dict):
            raise CadenceError(f'{where}[{i}] must be {{"type": "function", "function": {{"name": ...}}}}')
        if not isinstance(f.get("name"), str) or not f["name"]:
            raise CadenceError(f"{where}[{i}].function.name must be a non-empty string")
        if "parameters" in f and not isinstance(f["parameters"], dict):
            raise CadenceError(f"{where}[{i}].function.parameters must be a JSON schema object")
        names.append(f["name"])
    choice = "auto" if choice is None else choice
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        if choice.get("type") != "function" or name not in names:
            raise CadenceError(
                f"tool_choice names function {name!r}, which is not among the tools ({', '.join(names)})"
            )
        choice = name
    elif choice not in ("auto", "none", "required"):
        raise CadenceError(f'tool_choice={choice!r} must be "auto", "none", "required" or a function')
    return [{"type": "function", "function": t["function"]} for t in tools], choice
