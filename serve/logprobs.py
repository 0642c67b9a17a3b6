"""A completion's log-probabilities in OpenAI's two shapes (`logprobs` on chat completions, with `top_logprobs`;
`logprobs: N` on completions): each generated token's, under the target's own distribution, and the likeliest
tokens' beside it (speculative/verify.py keeps them as [id, log-probability, [[id, log-probability], ...]]). A stop
token is not part of the answer, nor of its log-probabilities. A streamed answer gets them whole in its last chunk.
An echoed completion's (`echo`) begin with its prompt's tokens'. What a request asks for is read here too."""

from __future__ import annotations

import dataclasses
import json
from typing import Callable

from common.errors import PromptError
from common.settings import MAX_LOGPROBS


def of(ask, done, tokenizer) -> dict | None:
    """The answer's log-probabilities in its endpoint's shape, where the request (`ask`, serve/requests.py) asked."""
    if done is None or ask.sampling.get("logprobs", -1) < 0:
        return None
    shape = for_chat if ask.chat else for_completion
    entries = kept(done, tokenizer.stop_ids)
    return shape(with_prompt(entries, done) if ask.echo else entries, lambda tid: tokenizer.decode([tid]))


def kept(done, stops: set[int]) -> list:
    """The answer's tokens' entries (a stop token's left out); [] where none were asked for."""
    return [e for e in (done.stats.get("logprobs") or []) if e[0] not in stops]


def for_chat(entries: list, piece: Callable[[int], str]) -> dict:
    """Chat completions' `choice.logprobs`: {"content": [{"token", "logprob", "bytes", "top_logprobs"}]}."""

    def one(tid: int, lp: float) -> dict:
        s = piece(tid)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    return {"content": [one(t, lp) | {"top_logprobs": [one(a, b) for a, b in top]} for t, lp, top in entries]}


def for_completion(entries: list, piece: Callable[[int], str]) -> dict:
    """Completions' `choice.logprobs`: {"tokens", "token_logprobs", "top_logprobs", "text_offset"}."""
    tokens = [piece(t) for t, _, _ in entries]
    offsets, at = [], 0
    for s in tokens:
        offsets.append(at)
        at += len(s)
    return {
        "tokens": tokens,
        "token_logprobs": [lp for _, lp, _ in entries],
        "top_logprobs": [None if lp is None else {piece(a): b for a, b in top} for _, lp, top in entries],
        "text_offset": offsets,
    }


def asked(body: dict, chat: bool) -> dict:
    """The sampling fields a request's log-probabilities ask for: {"logprobs": N} for its tokens' and the N likeliest
    beside each (chat's `logprobs: true` with `top_logprobs` 0-20, completions' `logprobs: N`), and where a
    completion is echoed, {"prompt_logprobs": True}: its prompt's tokens' too (lm-evaluation-harness scores a text
    so). A value out of its kind is a PromptError naming the parameter."""
    lp, top = body.get("logprobs"), body.get("top_logprobs")
    if chat:
        if lp is not None and not isinstance(lp, bool):
            raise PromptError(f"logprobs={_shown(lp)} must be true or false", "logprobs")
        if top is not None and (not _count(top) or not 0 <= top <= MAX_LOGPROBS):
            raise PromptError(f"top_logprobs={_shown(top)} must be an integer in [0, {MAX_LOGPROBS}]", "top_logprobs")
        if top is not None and not lp:
            raise PromptError("top_logprobs needs logprobs: true", "top_logprobs")
        return {"logprobs": top or 0} if lp else {}
    if top is not None:
        raise PromptError(
            "top_logprobs is a parameter of chat completions; completions take logprobs: N", "top_logprobs"
        )
    if lp is None or lp is False:
        return {}
    if not _count(lp) or not 0 <= lp <= MAX_LOGPROBS:
        raise PromptError(f"logprobs={_shown(lp)} must be an integer in [0, {MAX_LOGPROBS}]", "logprobs")
    return {"logprobs": lp} | ({"prompt_logprobs": True} if echoed(body, chat) else {})


def echoed(body: dict, chat: bool = False) -> bool:
    """A completion's `echo`: its prompt comes back before its answer (and its prompt's log-probabilities with)."""
    v = body.get("echo", False)
    if v is not None and not isinstance(v, bool):
        raise PromptError(f"echo={_shown(v)} must be true or false", "echo")
    return bool(v)


def with_prompt(entries: list, done) -> list:
    """An echoed completion's entries: its prompt's tokens' first (the first token's log-probability None: nothing
    comes before it), then its answer's."""
    ids = done.row["prompt_token_ids"]
    prompt = done.stats.get("prompt_logprobs") or [None] * len(ids)
    return [(t, None, []) if e is None else tuple(e) for t, e in zip(ids, prompt)] + entries


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _shown(v) -> str:
    text = json.dumps(v, ensure_ascii=True)
    return text if len(text) <= 40 else text[:37] + "..."


def echo(ask, done, text: str, tokenizer) -> tuple[str, object]:
    """An echoed completion's text (its prompt's, then its answer's) and its Completion; with max_tokens 0 (`scored`),
    the token generated dropped: the prompt's text and log-probabilities alone."""
    if not ask.echo or done is None:
        return text, done
    prompt = prompt_text(ask, tokenizer)
    if ask.scored:
        stats = {k: v for k, v in done.stats.items() if k != "logprobs"}
        return prompt, dataclasses.replace(done, text="", token_ids=[], finish_reason="length", stats=stats)
    return prompt + text, done


def prompt_text(ask, tokenizer) -> str:
    """An echoed prompt as it was sent: its text, or its token ids' text."""
    return ask.prompt.text or tokenizer.decode(list(ask.prompt.ids))
