"""Prompt sets (`{"id", "kind", "prompt"}` per JSONL line) and how a prompt becomes token ids."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from cadence.errors import CadenceError

# Kinds whose prompts are instructions: with --chat auto they get the model's chat template.
INSTRUCTION_KINDS = {"copy", "open", "chat"}


@dataclass(frozen=True)
class Prompt:
    id: str
    kind: str
    text: str
    chat: bool | None = None  # None: decided by --chat


def load_prompts(path: str | Path) -> list[Prompt]:
    path = Path(path)
    if not path.is_file():
        raise CadenceError(f"prompt file {path} does not exist")
    prompts = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompts.append(Prompt(str(row.get("id", f"p{n}")), str(row.get("kind", "complete")), row["prompt"], row.get("chat")))
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CadenceError(f"{path}:{n} is not a prompt line ({type(e).__name__}: {e}); "
                               'each line must be a JSON object with at least "prompt"') from None
    if not prompts:
        raise CadenceError(f"prompt file {path} holds no prompts")
    return prompts


def use_chat(prompt: Prompt, mode: str) -> bool:
    if prompt.chat is not None:
        return bool(prompt.chat)
    if mode == "auto":
        return prompt.kind in INSTRUCTION_KINDS
    return mode == "on"


def prompt_ids(tokenizer, prompt: Prompt, chat_mode: str) -> tuple[list[int], bool]:
    chat = use_chat(prompt, chat_mode)
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt.text}]) if chat else prompt.text
    return tokenizer.encode(text), chat
