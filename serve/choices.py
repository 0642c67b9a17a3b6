"""A request of several choices: `n` > 1, or a completions `prompt` that is a list of prompts (as
lm-evaluation-harness and OpenAI's batch clients send). Each choice is a generation of its own: it queues and
takes a slot like a request alone, so the choices run side by side in the slots (`--parallel`), and each is
what that prompt alone would get. Their answers are put back together as OpenAI does: the choices indexed
prompt by prompt, `n` to a prompt; the usage summed (each prompt counted once); streamed, the chunks of all
choices interleaved as they come, each with its choice's index, one `[DONE]` at the end."""

from __future__ import annotations

import asyncio

from serve.requests import ClientError


FAILED = object()  # a choice's stream ended without an answer (the server stopped it): the whole stream ends
SEEDS = 1 << 63  # seeds wrap below this (common/settings.py takes 0 <= seed < 2**64)


def split(body: dict, chat: bool, most: int) -> tuple[list[dict], int]:
    """One body a choice, each asking for one (`n` 1, one prompt), and `n`. The j-th sample of every prompt gets the seed
    `seed + j`: a batch's first sample of a prompt is what that prompt alone with the seed gets, and a request
    repeated gets the same choices. More than `most` choices (what the queue holds) is a 400."""
    n = body.get("n", 1)
    if n is None:
        n = 1
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ClientError(400, f"n={n!r} must be a positive integer: the choices wanted", "n")
    prompts = [body.get("prompt")]
    p = body.get("prompt")
    if not chat and isinstance(p, list) and len(p) > 1 and all(isinstance(x, (str, list)) for x in p):
        prompts = p  # a list of prompts (texts, or lists of token ids); a list of integers is one prompt's ids
    if len(prompts) * n > most:
        raise ClientError(
            400,
            f"{len(prompts)} prompt(s) x n={n} is {len(prompts) * n} choices; this server queues at most {most} "
            "(launch serve --queue): send fewer at a time",
            "n" if n > 1 else "prompt",
        )
    seed = body.get("seed")
    seeded = isinstance(seed, int) and not isinstance(seed, bool)
    bodies = []
    for prompt in prompts:
        for j in range(n):
            one = dict(body, n=1) | ({} if chat else {"prompt": prompt})
            bodies.append(one | ({"seed": (seed + j) % SEEDS if j else seed} if seeded else {}))
    return bodies, n


def merge(responses: list[dict], n: int) -> dict:
    """The choices' responses (each of one choice) as one: indexed in order, the usage summed."""
    out = dict(responses[0])
    out["choices"] = [r["choices"][0] | {"index": i} for i, r in enumerate(responses)]
    out["usage"] = summed([r["usage"] for r in responses], n)
    return out


def summed(usages: list[dict], n: int) -> dict:
    """The choices' usages as one: the tokens made summed, each prompt's counted once (the most any of its `n`
    choices says: one that ended at a stop string says none)."""
    prompt = sum(max(u["prompt_tokens"] for u in usages[i : i + n]) for i in range(0, len(usages), n))
    made = sum(u["completion_tokens"] for u in usages)
    return {"prompt_tokens": prompt, "completion_tokens": made, "total_tokens": prompt + made}


async def gathered(answers: list, failure: type) -> list | object:
    """Every choice's answer, in order; or the first that is a `failure` (the others are left to the caller to stop
    at once, not waited for)."""
    tasks = [asyncio.ensure_future(a) for a in answers]
    try:
        for done in asyncio.as_completed(tasks):
            if isinstance(got := await done, failure):
                return got
        return [t.result() for t in tasks]
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def interleave(streams: list) -> object:
    """The events of every choice's stream, as each comes; closed early, it closes them all (so their generations
    stop at the next cycle). A stream that raised raises here."""
    events: asyncio.Queue = asyncio.Queue()

    async def pump(stream):
        try:
            async for event in stream:
                await events.put(event)
        finally:
            await events.put(None)

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        left = len(tasks)
        while left:
            event = await events.get()
            if event is not None:
                yield event
                continue
            left -= 1
            for t in tasks:
                if t.done() and not t.cancelled() and t.exception() is not None:
                    raise t.exception()
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class Jobs:
    """The choices' jobs, as the access log reads one: the tokens generated, once every one is done."""

    def __init__(self, jobs: list):
        self.jobs = jobs

    @property
    def tokens(self) -> int | None:
        counts = [j.tokens for j in self.jobs if j.tokens is not None]
        return sum(counts) if counts else None
