"""Prompt sets (`{"id", "kind", "prompt"}` per JSONL line) and how a prompt becomes token ids."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from common.errors import CadenceError, PromptError
from text.textcheck import TooLong

# The development prompt set: bench and profile default to it. The shared folder beside the checkout
# holds the team's copy; the package carries one (engine/assets) for a checkout or wheel anywhere else.
_SHARED_PROMPTS = Path(__file__).resolve().parents[2] / "shared" / "prompts" / "dev.jsonl"
DEFAULT_PROMPTS = (
    _SHARED_PROMPTS if _SHARED_PROMPTS.exists() else Path(__file__).resolve().parent / "assets" / "dev.jsonl"
)

# Kinds whose prompts are instructions: with --chat auto they get the model's chat template.
INSTRUCTION_KINDS = {"copy", "open", "chat"}


@dataclass(frozen=True)
class Prompt:
    id: str
    kind: str
    text: str
    chat: bool | None = None  # None: decided by --chat
    # a conversation ({"role", "content"} dicts, the last one the user's): rendered by the chat template
    messages: tuple = ()
    ids: tuple | None = None  # its token ids, once encoded (Runner.prepare): `chat` then says if it got the template
    tools: tuple = ()  # the tools its template is told of (engine/tools.py), in OpenAI's form
    start: str = ""  # the answer's forced opening, after the template (a call forced by tool_choice)

    def key(self, chat_mode: str) -> tuple | None:
        """What its token ids depend on (a run encodes each prompt of a set once); None: a conversation."""
        return None if self.messages or self.ids is not None else (self.text, use_chat(self, chat_mode))


def load_prompts(path: str | Path) -> list[Prompt]:
    path = Path(path)
    if not path.is_file():
        raise CadenceError(f"prompt file {path} does not exist")
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise CadenceError(f"cannot read the prompt file {path} ({e}); it must be UTF-8 JSONL") from None
    prompts = [_prompt(path, n, line) for n, line in enumerate(lines, 1) if line.strip()]
    if not prompts:
        raise CadenceError(f"prompt file {path} holds no prompts")
    return prompts


def _prompt(path: Path, n: int, line: str) -> Prompt:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise CadenceError(
            f"{path}:{n} is not a prompt line (not JSON: {e.msg}, column {e.colno}); "
            'each line must be a JSON object with at least "prompt"'
        ) from None
    why = (
        f"{_json_kind(row)}, not an object"
        if not isinstance(row, dict)
        else 'it has no "prompt" field'
        if "prompt" not in row
        else f'its "prompt" is {_json_kind(row["prompt"])}, not a string'
        if not isinstance(row["prompt"], str)
        else None
    )
    if why:
        raise CadenceError(
            f'{path}:{n} is not a prompt line ({why}); each line must be a JSON object with at least "prompt"'
        )
    return Prompt(str(row.get("id", f"p{n}")), str(row.get("kind", "complete")), row["prompt"], row.get("chat"))


def _json_kind(v) -> str:
    kinds = {
        dict: "an object",
        list: "an array",
        str: "a string",
        bool: "true or false",
        int: "a number",
        float: "a number",
    }
    return kinds.get(type(v), "null")


def use_chat(prompt: Prompt, chat: str) -> bool:
    """Whether the prompt gets the chat template: its own say, else --chat (auto: instructions and
    conversations do, code to complete does not)."""
    if prompt.messages:
        return True
    if prompt.chat is not None:
        return bool(prompt.chat)
    if chat == "auto":
        return prompt.kind in INSTRUCTION_KINDS
    return chat == "on"


def encode_prompt(tokenizer, prompt: Prompt, chat_mode: str, limit: int | None = None) -> tuple[list[int], bool]:
    """The prompt as token ids, after the chat template if it gets one; whether it did. With --chat
    auto a model without a template of its own (a base model: none in its files, or only the family's that
    cadence knows, as for Gemma 3 270M's base GGUF) gets the raw text. `limit`: the context, for the
    tokenizer's cheap refusal of a text that cannot fit."""
    chat = use_chat(prompt, chat_mode)
    if chat and chat_mode == "auto" and prompt.chat is None and not own_template(tokenizer) and not prompt.messages:
        chat = False
    try:
        if not chat:
            return tokenizer.encode(prompt.text, limit=limit), False
        from engine.tools import for_template

        messages = for_template(list(prompt.messages)) or [{"role": "user", "content": prompt.text}]
        tools = list(prompt.tools) or None
        text = tokenizer.apply_chat_template(messages, name="messages" if prompt.messages else None, tools=tools)
        text += prompt.start
        return tokenizer.encode(text, limit=limit), True
    except TooLong as e:
        raise PromptError(
            f"{e.name} has {'' if e.exact else 'at least '}{e.tokens} tokens, but the context holds "
            f"{e.limit}; shorten it or give a larger --context",
            _param(e.name, prompt),
        ) from None
    except CadenceError as e:  # text that is not text: this prompt's, not the run's
        raise PromptError(str(e), _param(str(e), prompt)) from None


def own_template(tokenizer) -> bool:
    """Whether the model's files carry a chat template (an instruct model), not just the family's default."""
    from text.tokenizer_gguf import FAMILY_TEMPLATES

    template = tokenizer.info.chat_template
    return bool(template) and template not in FAMILY_TEMPLATES


def _param(message: str, prompt: Prompt) -> str:
    """The request field an encoding error is about: a message's path (`messages[2].content`), else the prompt."""
    first = message.split(" ", 1)[0]
    return first if first.startswith("messages") else "messages" if prompt.messages else "prompt"
