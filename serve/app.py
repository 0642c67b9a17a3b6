"""An OpenAI-compatible HTTP API on cadence's runtime (`launch serve`).

    POST /v1/chat/completions   messages -> the model's chat template -> an answer (stream: server-sent events)
    POST /v1/completions        prompt -> its continuation (stream: server-sent events)
    GET  /v1/models             the one model served
    GET  /health                200 once the models are loaded (503 while loading, 500 if they failed)
    GET  /metrics               Prometheus text: tokens/s, acceptance, memory against the budget, disk GB/s
    GET  /                      a chat page (serve/chat.html: one file, nothing fetched from elsewhere): answers
                                streamed, code blocks drawn, a stop button, the run's live figures from /metrics

The models load once, in one generation thread that owns the runtime (serve/generator.py). Requests
wait in a bounded queue, one generation at a time: a full queue answers 429. A request is read and
checked before it queues (serve/requests.py): what a client got wrong is a 4xx in OpenAI's error
shape naming the parameter (400; 404 for a model not served; 413 for a body over `max_body`), never
a 500. A client that goes away stops its generation at the next cycle boundary. With an API key,
every /v1 route and /metrics want `Authorization: Bearer <key>` (compared in constant time).
Requests that leave `temperature` out get the server's own (0: greedy, the target model's own text).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import queue
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path

from sse_starlette.sse import EventSourceResponse
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.middleware import Middleware
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from common.errors import PromptError
from serve import logprobs
from serve.generator import Generator, Job
from engine import tools
from serve import choices
from serve.metrics import AccessLog
from serve.requests import Ask, ClientError, parse_json, read_ask
from serve.structured import forced_call_grammar

MAX_BODY = 4 << 20  # a request body larger than this is refused (413) before it is read whole
RETRY_AFTER_S = 2  # what a 429 asks a client to wait (a slot frees within a few cycles of a generation)
PAGE = Path(__file__).with_name("chat.html")


@dataclass(frozen=True)
class ServeConfig:
    model: str  # the id /v1/models lists
    api_key: str | None = None
    budget: int | None = None  # the memory budget the run was planned for
    max_body: int = MAX_BODY
    open_metrics: bool = False  # /metrics without the key
    approximate: str | None = None  # --mode flash: what every response says it is (not the target's exact output)
    access_log: bool = True  # a line per request on stderr (launch serve --quiet: none)

    @property
    def fingerprint(self) -> str:
        """The responses' `system_fingerprint`: lossless, or which approximation."""
        return f"cadence-approximate-{self.approximate}" if self.approximate else "cadence-lossless"

    def aliases(self) -> set[str]:
        """Names a request may give the served model by: its id, and for a file its name and stem."""
        p = Path(self.model)
        return {self.model, p.name, p.stem}


def error(e: ClientError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


class Api:
    def __init__(self, gen: Generator, cfg: ServeConfig):
        self.gen, self.cfg, self.created = gen, cfg, int(time.time())
        self.page = PAGE.read_text()

    async def chat_page(self, request: Request):
        """The chat page: it holds no secret (the API key, where one is wanted, is typed into it)."""
        return HTMLResponse(self.page)

    def authorized(self, request: Request) -> bool:
        if self.cfg.api_key is None:
            return True
        got = request.headers.get("authorization", "").encode("utf-8", "replace")
        return hmac.compare_digest(got, f"Bearer {self.cfg.api_key}".encode())

    def _guard(self, request: Request) -> None:
        if not self.authorized(request):
            raise ClientError(
                401, "a valid API key is needed: Authorization: Bearer <key>", None, "authentication_error"
            )

    async def health(self, request: Request):
        gen = self.gen
        if gen.error and gen.llm is None:
            return JSONResponse({"status": "error", "error": gen.error}, status_code=500)
        if not gen.ready.is_set():
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse(
            {
                "status": "ok",
                "model": self.cfg.model,
                "queued": gen.jobs.qsize(),
                "busy": gen.busy,
                "config": gen.llm.plan.options(),
            }
        )

    async def models(self, request: Request):
        try:
            self._guard(request)
        except ClientError as e:
            return error(e)
        return JSONResponse(
            {
                "object": "list",
                "data": [{"id": self.cfg.model, "object": "model", "created": self.created, "owned_by": "cadence"}],
            }
        )

    async def metrics(self, request: Request):
        if not self.cfg.open_metrics and not self.authorized(request):
            return error(
                ClientError(
                    401,
                    "a valid API key is needed for /metrics (or start the server with --open-metrics)",
                    None,
                    "authentication_error",
                )
            )
        from serve.metrics import prometheus

        return PlainTextResponse(prometheus(self.gen, self.cfg.budget), media_type="text/plain; version=0.0.4")

    async def completions(self, request: Request):
        return await self.generate(request, chat=False)

    async def chat_completions(self, request: Request):
        return await self.generate(request, chat=True)

    async def generate(self, request: Request, chat: bool):
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        try:
            self._guard(request)
            self._loaded()
            bodies, n = choices.split(parse_json(await self._body(request)), chat, self.gen.jobs.maxsize)
            asks = [await self._prepare(read_ask(b, chat, rid, self.cfg.aliases())) for b in bodies]
        except ClientError as e:
            return error(e)
        jobs = [Job(ask, asyncio.get_running_loop()) for ask in asks]
        request.state.job = jobs[0] if len(jobs) == 1 else choices.Jobs(jobs)  # its tokens, for the access log
        if not self._queued(jobs):
            self.gen.stats.rejected += 1
            busy = error(
                ClientError(
                    429, f"{self.gen.jobs.maxsize} requests are waiting already; retry later", None, "rate_limit_error"
                )
            )
            busy.headers["Retry-After"] = str(RETRY_AFTER_S)
            return busy
        self.gen.stats.requests += 1
        if asks[0].stream:
            events = self._events(jobs[0], rid) if len(jobs) == 1 else self._several_events(jobs, rid, n)
            return EventSourceResponse(events, ping=15, send_timeout=30)
        try:
            answers = await choices.gathered([self._whole(request, job, rid) for job in jobs], JSONResponse)
        finally:
            for job in jobs:  # one choice failed, or the request's task was cancelled: the others stop too
                self.gen.left(job)
        if isinstance(answers, JSONResponse):
            return answers
        return JSONResponse(answers[0] if len(jobs) == 1 else choices.merge(answers, n))

    def _queued(self, jobs: list[Job]) -> bool:
        """All the request's generations queued, or none (the queue had no room for them all)."""
        for i, job in enumerate(jobs):
            try:
                self.gen.jobs.put_nowait(job)
            except queue.Full:
                for put in jobs[:i]:  # taken back: not counted as cancelled by a client
                    put.cancelled.set()
                    self.gen.jobs.discard(put)
                return False
        return True

    def _loaded(self) -> None:
        if not self.gen.ready.is_set():
            raise ClientError(503, "the models are still loading; retry in a few seconds", None, "server_error")
        if self.gen.llm is None:
            raise ClientError(500, f"the models failed to load: {self.gen.error}", None, "server_error")

    async def _body(self, request: Request) -> bytes:
        """The body, refused (413) past `max_body` without reading more of it."""
        limit = self.cfg.max_body
        too_big = ClientError(413, f"the request body is larger than {limit} bytes (launch serve --max-body)")
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise too_big
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > limit:
                raise too_big
        return bytes(body)

    async def _prepare(self, ask: Ask) -> Ask:
        """The prompt encoded and checked against the context off the event loop: a prompt or a max_tokens
        that cannot fit is the client's 400, before the request waits for the generation thread. With tools: the
        model's format of calls (a template that takes none: 400), and a forced call's opening."""
        runner = self.gen.llm.runner
        prompt, calls = ask.prompt, None
        if prompt.tools:
            calls = tools.format_of(runner.tokenizer.info.chat_template)
            if calls is None:
                raise ClientError(400, tools.no_tools(self.cfg.model), "tools")
            if ask.tool_choice == "none":  # the model answers in words: it is not told of the tools
                prompt, calls = replace(prompt, tools=()), None
        try:
            if calls is not None and ask.tool_choice != "auto":  # the call forced, and held to its function's schema
                prompt = replace(prompt, start=tools.forced_start(calls, ask.tool_choice))
                ask = replace(ask, sampling=ask.sampling | {"grammar": forced_call_grammar(calls, ask, prompt.tools)})
            prompt = await run_in_threadpool(runner.prepare, prompt, ask.max_new_tokens)
        except PromptError as e:
            raise ClientError(400, str(e), "messages" if ask.chat and e.param == "prompt" else e.param) from None
        return replace(ask, prompt=prompt, calls=calls)

    async def _whole(self, request: Request, job: Job, rid: str):
        text = ""
        while True:
            try:
                kind, value = await asyncio.wait_for(job.out.get(), timeout=0.25)
            except asyncio.TimeoutError:
                if await request.is_disconnected() and self.gen.left(job):  # the client left while it waited
                    return self._failed("cancelled", None, job)
                continue
            if kind == "piece":
                text += value
            elif kind in ("error", "client_error", "cancelled"):
                return self._failed(kind, value, job)
            else:
                done = value if kind == "done" else None
                return self._response(job, rid, done.text if done else value, done)

    def _failed(self, kind: str, value, job: Job) -> JSONResponse:
        if kind == "client_error":
            return error(ClientError(400, str(value), value.param))
        if kind == "cancelled":
            return error(ClientError(499, "the client closed the request", None, "cancelled"))
        return error(ClientError(500, value, None, "server_error"))

    def _response(self, job: Job, rid: str, text: str, done) -> dict:
        chat, ask = job.ask.chat, job.ask
        text, done = logprobs.echo(ask, done, text, self.gen.llm.runner.tokenizer)
        choice = {
            "index": 0,
            "finish_reason": done.finish_reason if done else "stop",
            "logprobs": logprobs.of(job.ask, done, self.gen.llm.runner.tokenizer),
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
            "model": self.cfg.model,
            "system_fingerprint": self.cfg.fingerprint,
            "choices": [choice],
            "usage": usage(done),
        }

    async def _several_events(self, jobs: list[Job], rid: str, n: int):
        """The choices' streams interleaved (serve/choices.py), then the usage summed where asked, one [DONE]."""
        streams = [self._events(job, rid, i, alone=False) for i, job in enumerate(jobs)]
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
                self.gen.left(job)
        if jobs[0].ask.include_usage:
            summed = choices.summed([usage(j.done) for j in jobs], n)
            yield {"data": self._chunk(jobs[0].ask.chat, rid, [], usage=summed)}
        yield {"data": "[DONE]"}

    def _chunk(self, chat: bool, rid: str, parts: list, **more) -> str:
        """A streamed chunk of the response `rid`: its choices' `parts` (and `more`, the usage)."""
        kind, cfg = "chat.completion.chunk" if chat else "text_completion", self.cfg
        head = {"id": rid, "object": kind, "created": int(time.time()), "model": cfg.model}
        return json.dumps(head | {"system_fingerprint": cfg.fingerprint, "choices": parts} | more)

    async def _events(self, job: Job, rid: str, index: int = 0, alone: bool = True):
        """A choice's server-sent events; `alone`: the request's only one, which ends the stream itself."""
        chat = job.ask.chat

        def chunk(delta: str | None, finish: str | None = None, role: bool = False, call: dict | None = None, lp=None):
            c = {"index": index, "finish_reason": finish, "logprobs": lp}
            if chat:
                c["delta"] = ({"role": "assistant"} if role else {}) | ({"content": delta} if delta is not None else {})
                c["delta"] |= {"tool_calls": [call]} if call is not None else {}
            else:
                c["text"] = delta or ""
            return self._chunk(chat, rid, [c])

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
                yield {"data": chunk(logprobs.prompt_text(job.ask, self.gen.llm.runner.tokenizer))}
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
                    lp = logprobs.of(job.ask, value if kind == "done" else None, self.gen.llm.runner.tokenizer)
                    yield {"data": chunk(None, "tool_calls" if made and finish == "stop" else finish, lp=lp)}
                    if not alone:
                        return
                    if job.ask.include_usage:
                        yield {"data": self._chunk(chat, rid, [], usage=usage(value if kind == "done" else None))}
                    yield {"data": "[DONE]"}
                    return
        finally:
            self.gen.left(job)  # a client that left mid-stream (or any end): its generation stops at the next cycle


def usage(done) -> dict:
    if done is None:
        return {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    n = len(done.token_ids)
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": n, "total_tokens": done.prompt_tokens + n}


def make_app(gen: Generator, cfg: ServeConfig) -> Starlette:
    api = Api(gen, cfg)
    return Starlette(
        routes=[
            Route("/", api.chat_page),
            Route("/favicon.ico", lambda request: Response(status_code=204)),
            Route("/health", api.health),
            Route("/metrics", api.metrics),
            Route("/v1/models", api.models),
            Route("/v1/completions", api.completions, methods=["POST"]),
            Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
        ],
        middleware=[Middleware(AccessLog)] if cfg.access_log else [],
    )
