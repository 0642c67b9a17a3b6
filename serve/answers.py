"""A request's answer in OpenAI's shapes, from its generation's events (serve/generator.py `Job`): the whole
response (`whole`), or a choice's server-sent events (`events`; several choices' interleaved, `several_events`),
with the tool calls read out of the text, log-probabilities where asked and the usage. serve/app.py routes the
requests and queues their generations; this is what goes back."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

from starlette.requests import Request
from starlette.responses import JSONResponse

from engine import tools
from serve import choices, logprobs
from serve.generator import Job
from serve.requests import ClientError


def error(e: ClientError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


class Answers:
    def __init__(self, model: str, fingerprint: str, tokenizer, left):
        """`model`: the id the answers name; `fingerprint`: their `system_fingerprint`; `tokenizer`: the served
        model's (log-probabilities and echoed prompts); `left(job)`: a job's generation stops (its client left)."""
        self.model, self.fingerprint, self.tokenizer, self.left = model, fingerprint, tokenizer, left

    async def whole(self, request: Request, job: Job, rid: str):
        text = ""
        while True:
            try:
                kind, value = await asyncio.wait_for(job.out.get(), timeout=0.25)
            except asyncio.TimeoutError:
                if await request.is_disconnected() and self.left(job):  # the client left while it waited
                    return self.failed("cancelled", None, job)
                continue
            if kind == "piece":
                text += value
            elif kind in ("error", "client_error", "cancelled"):
                return self.failed(kind, value, job)
            else:
                done = value if kind == "done" else None
                return self.response(job, rid, done.text if done else value, done)

    def failed(self, kind: str, value, job: Job) -> JSONResponse:
        if kind == "client_error":
            return error(ClientError(400, str(value), value.param))
        if kind == "cancelled":
            return error(ClientError(499, "the client closed the request", None, "cancelled"))
        return error(ClientError(500, value, None, "server_error"))

    def response(self, job: Job, rid: str, text: str, done) -> dict:
        chat, ask = job.ask.chat, job.ask
        text, done = logprobs.echo(ask, done, text, self.tokenizer)
        choice = {
            "index": 0,
            "finish_reason": done.finish_reason if done else "stop",
            "logprobs": logprobs.of(job.ask, done, self.tokenizer),
        }
        message = {"role": "assistant", "content": text}
        if ask.calls is not None:  # the answer's tool calls read out of it
            content, calls = tools.parse(ask.prompt.start + text, ask.calls, tools.names(ask.prompt.tools))
            calls = calls if ask.parallel_tool_calls else calls[:1]
            if calls:
                message = {"role": "assistant", "content": content.strip() or None}
                message["tool_calls"] = [c.openai() for c in calls]
                choice["finish_reason"] = "tool_calls" if choice["finish_reason"] == "stop" else choice["finish_reason"]
        choice.update({"message": message} if chat else {"text": text})
        return {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model,
            "system_fingerprint": self.fingerprint,
            "choices": [choice],
            "usage": usage(done),
        }

    async def several_events(self, jobs: list[Job], rid: str, n: int):
        """The choices' streams interleaved (serve/choices.py), then the usage summed where asked, one [DONE]."""
        streams = [self.events(job, rid, i, alone=False) for i, job in enumerate(jobs)]
        try:
            async with contextlib.aclosing(choices.interleave(streams)) as events:
                async for event in events:
                    if event is choices.FAILED:
                        return
                    yield event
                    if event["data"].startswith('{"error"'):
                        return
        finally:
            for job in jobs:
                self.left(job)
        if jobs[0].ask.include_usage:
            summed = choices.summed([usage(j.done) for j in jobs], n)
            yield {"data": self.chunk_of(jobs[0].ask.chat, rid, [], usage=summed)}
        yield {"data": "[DONE]"}

    def chunk_of(self, chat: bool, rid: str, parts: list, **more) -> str:
        """A streamed chunk of the response `rid`: its choices' `parts` (and `more`, the usage)."""
        kind = "chat.completion.chunk" if chat else "text_completion"
        head = {"id": rid, "object": kind, "created": int(time.time()), "model": self.model}
        return json.dumps(head | {"system_fingerprint": self.fingerprint, "choices": parts} | more)

    async def events(self, job: Job, rid: str, index: int = 0, alone: bool = True):
        """A choice's server-sent events; `alone`: the request's only one, which ends the stream itself."""
        chat = job.ask.chat

        def chunk(delta: str | None, finish: str | None = None, role: bool = False, call: dict | None = None, lp=None):
            c = {"index": index, "finish_reason": finish, "logprobs": lp}
            if chat:
                c["delta"] = ({"role": "assistant"} if role else {}) | ({"content": delta} if delta is not None else {})
                c["delta"] |= {"tool_calls": [call]} if call is not None else {}
            else:
                c["text"] = delta or ""
            return self.chunk_of(chat, rid, [c])

        calls = tools.CallStream(job.ask.calls, tools.names(job.ask.prompt.tools)) if job.ask.calls else None
        made = []  # the calls sent

        def pieces(events) -> list[dict]:
            out = []
            for kind, v in events:
                if kind == "text" and v:
                    out.append({"data": chunk(v)})
                elif kind == "call" and (job.ask.parallel_tool_calls or not made):
                    out.append({"data": chunk(None, call=v.openai(len(made)))})
                    made.append(v)
            return out

        try:
            if chat:
                yield {"data": chunk("", role=True)}
            elif job.ask.echo:  # the prompt first, as it was sent (its ids' text where ids were sent)
                yield {"data": chunk(logprobs.prompt_text(job.ask, self.tokenizer))}
            if calls is not None:
                for event in pieces(calls.push(job.ask.prompt.start)):
                    yield event
            while True:
                kind, value = await job.out.get()
                if kind == "piece":
                    events = pieces(calls.push(value)) if calls is not None else [{"data": chunk(value)}] * bool(value)
                    for event in events:
                        yield event
                elif kind in ("error", "client_error"):
                    yield {
                        "data": json.dumps(
                            ClientError(
                                400 if kind == "client_error" else 500, str(value), getattr(value, "param", None)
                            ).body()
                        )
                    }
                    return
                elif kind == "cancelled":
                    if not alone:  # the server stopping it: the whole stream ends, as a choice alone's does
                        yield choices.FAILED
                    return
                else:
                    for event in pieces(calls.finish()) if calls is not None else []:
                        yield event
                    finish = value.finish_reason if kind == "done" else "stop"
                    lp = logprobs.of(job.ask, value if kind == "done" else None, self.tokenizer)
                    yield {"data": chunk(None, "tool_calls" if made and finish == "stop" else finish, lp=lp)}
                    if not alone:
                        return
                    if job.ask.include_usage:
                        yield {"data": self.chunk_of(chat, rid, [], usage=usage(value if kind == "done" else None))}
                    yield {"data": "[DONE]"}
                    return
        finally:
            self.left(job)  # a client that left mid-stream (or any end): its generation stops at the next cycle


def usage(done) -> dict:
    if done is None:
        return {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    n = len(done.token_ids)
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": n, "total_tokens": done.prompt_tokens + n}
