"""An OpenAI-compatible HTTP API on cadence's runtime (`launch serve`).

    POST /v1/chat/completions   messages -> the model's chat template -> an answer (stream: server-sent events)
    POST /v1/completions        prompt -> its continuation (stream: server-sent events)
    GET  /v1/models             the one model served
    GET  /health                200 once the models are loaded (503 while loading, 500 if they failed)
    GET  /metrics               Prometheus text: tokens/s, acceptance, memory against the budget, disk GB/s
    GET  /                      a chat page (serve/chat.html: one file, nothing fetched from elsewhere): answers
                                streamed, code blocks drawn, a stop button, the run's live figures from /metrics

The models load once, in one generation thread that owns the runtime (serve/generator.py). Requests
wait in a bounded queue for a slot of the run's batch (one, or `--parallel N`): a full queue answers 429. What
goes back, a whole response or its server-sent events, is shaped by serve/answers.py. A request is read and
checked before it queues (serve/requests.py): what a client got wrong is a 4xx in OpenAI's error
shape naming the parameter (400; 404 for a model not served; 413 for a body over `max_body`), never
a 500. A client that goes away stops its generation at the next cycle boundary. With an API key,
every /v1 route and /metrics want `Authorization: Bearer <key>` (compared in constant time).
Requests that leave `temperature` out get the server's own (0: greedy, the target model's own text).
"""

from __future__ import annotations

import asyncio
import hmac
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
from serve.generator import Generator, Job
from engine import tools
from serve import choices
from serve.answers import Answers, error
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


class Api:
    def __init__(self, gen: Generator, cfg: ServeConfig):
        self.gen, self.cfg, self.created = gen, cfg, int(time.time())
        self.page = PAGE.read_text()
        self.answers: Answers | None = None  # made once the models are loaded (the tokenizer is theirs)

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
        out = self._answers()
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
            events = out.events(jobs[0], rid) if len(jobs) == 1 else out.several_events(jobs, rid, n)
            return EventSourceResponse(events, ping=15, send_timeout=30)
        try:
            answers = await choices.gathered([out.whole(request, job, rid) for job in jobs], JSONResponse)
        finally:
            for job in jobs:  # one choice failed, or the request's task was cancelled: the others stop too
                self.gen.left(job)
        if isinstance(answers, JSONResponse):
            return answers
        return JSONResponse(answers[0] if len(jobs) == 1 else choices.merge(answers, n))

    def _answers(self) -> Answers:
        if self.answers is None:
            runner = self.gen.llm.runner
            self.answers = Answers(self.cfg.model, self.cfg.fingerprint, runner.tokenizer, self.gen.left)
        return self.answers

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
