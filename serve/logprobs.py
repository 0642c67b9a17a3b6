"""A completion's log-probabilities in OpenAI's two shapes (`logprobs` on chat completions, with `top_logprobs`;
`logprobs: N` on completions): each generated token's, under the target's own distribution, and the likeliest
tokens' beside it (speculative/verify.py keeps them as [id, log-probability, [[id, log-probability], ...]]). A stop
token is not part of the answer, nor of its log-probabilities. A streamed answer gets them whole in its last chunk."""

from __future__ import annotations

from typing import Callable


def of(ask, done, tokenizer) -> dict | None:
    """The answer's log-probabilities in its endpoint's shape, where the request (`ask`, serve/requests.py) asked."""
    if done is None or ask.sampling.get("logprobs", -1) < 0:
        return None
    shape = for_chat if ask.chat else for_completion
    return shape(kept(done, tokenizer.stop_ids), lambda tid: tokenizer.decode([tid]))


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
        "top_logprobs": [{piece(a): b for a, b in top} for _, _, top in entries],
        "text_offset": offsets,
    }
