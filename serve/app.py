"""An OpenAI-compatible HTTP API on cadence's runtime (`launch serve`).

    POST /v1/chat/completions   messages -> the model's chat template -> an answer (stream: server-sent events)
    POST /v1/completions        prompt -> its continuation (stream: server-sent events)
    GET  /v1/models             the one model served
    GET  /health                200 once the models are loaded (503 while loading, 500 if they failed)
    GET  /metrics               Prometheus text: tokens/s, acceptance, memory against the budget, disk GB/s

The models load once, in one generation thread that owns the runtime (the actors it spawns live as
long as that thread). Requests wait in a bounded queue, one generation at a time: a full queue
answers 429. A client that goes away (a closed stream, a dropped connection) stops its generation
at the next cycle boundary, and the next request starts at once. With an API key, every /v1 route
wants `Authorization: Bearer <key>`. Requests that leave `temperature` out get the server's own
(`--temperature`, 0: greedy, so the text is exactly the target model's).
"""
from __future__ import annotations

import asyncio
import json
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route
from sse_starlette.sse import EventSourceResponse

from common.errors import CadenceError

log = logging.getLogger("cadence.serve")


@dataclass
class Job:
    """One request's generation: what to run, where its pieces go, whether its client left."""
    chat: bool
    payload: object  # a prompt string, or a list of messages
    params: dict
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def put(self, kind: str, value=None) -> None:
        self.loop.call_soon_threadsafe(self.out.put_nowait, (kind, value))


class Generator(threading.Thread):
    """Owns the model pair: loads it, then serves one job at a time from a bounded queue."""

    def __init__(self, make_llm, queue_size: int):
        super().__init__(name="cadence-generator", daemon=True)
        self.make_llm, self.jobs = make_llm, queue.Queue(maxsize=queue_size)
        self.llm = None
        self.error: str | None = None
        self.ready = threading.Event()
        self.busy = False
        self.stats = Metrics()

    def run(self) -> None:
        try:
            self.llm = self.make_llm()
        except Exception as e:  # noqa: BLE001 - /health and the command say it in one sentence
            self.error = str(e) if isinstance(e, CadenceError) else f"{type(e).__name__}: {e}"
            self.ready.set()
            return
        self.ready.set()
        try:
            while (job := self.jobs.get()) is not None:
                self.busy = True
                try:
                    self._serve(job)
                finally:
                    self.busy = False
        finally:
            self.llm.close()

    def _serve(self, job: Job) -> None:
        if job.cancelled.is_set():
            job.put("cancelled")
            return
        p = job.params
        kw = {k: p[k] for k in ("max_new_tokens", "temperature", "top_p", "seed") if p.get(k) is not None}
        try:
            chunks = (self.llm.chat_stream if job.chat else self.llm.stream)(job.payload, **kw)
            text = ""
            for chunk in chunks:
                text += chunk.text
                cut = _stop_at(text, p.get("stop") or [])
                if cut is not None:  # a stop string: the text up to it, and the generation ends here
                    chunks.close()
                    job.put("piece", chunk.text[:max(0, len(chunk.text) - (len(text) - cut))])
                    job.put("stopped", text[:cut])
                    return
                if chunk.text:
                    job.put("piece", chunk.text)
                if chunk.completion is not None:
                    self.stats.record(chunk.completion)
                    job.put("done", chunk.completion)
                    return
                if job.cancelled.is_set():
                    chunks.close()  # at a cycle boundary: the models agree with the text; the next job starts afresh
                    self.stats.cancelled += 1
                    job.put("cancelled")
                    return
        except CadenceError as e:
            job.put("error", str(e))
        except Exception as e:  # noqa: BLE001 - an actor died or failed: this request fails with the reason
            log.exception("generation failed")
            self.error = f"{type(e).__name__}: {e}"
            job.put("error", self.error)

    def stop(self) -> None:
        for job in list(self.jobs.queue):
            job.cancelled.set()
        try:
            self.jobs.put(None, timeout=5)
        except queue.Full:
            pass


def _stop_at(text: str, stops: list[str]) -> int | None:
    hits = [text.find(s) for s in stops if s and s in text]
    return min(hits) if hits else None


@dataclass
class Metrics:
    requests: int = 0
    rejected: int = 0  # 429: the queue was full
    cancelled: int = 0
    tokens: int = 0
    prompt_tokens: int = 0
    last_tokens_per_s: float = 0.0
    accepted: int = 0
    verifications: int = 0
    bytes_read: int = 0
    read_s: float = 0.0

    def record(self, c) -> None:
        self.tokens += len(c.token_ids)
        self.prompt_tokens += c.prompt_tokens
        self.last_tokens_per_s = c.tokens_per_s
        self.accepted += c.stats.get("accepted", 0)
        self.verifications += c.stats.get("verifications", 0)
        self.bytes_read += c.stats.get("bytes_read", 0)
        self.read_s += c.stats.get("read_s", 0.0)


def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def _params(body: dict, chat: bool) -> dict:
    """The request's generation settings, checked: one sentence for anything a model cannot do."""
    out = {}
    n = body.get("max_completion_tokens", body.get("max_tokens")) if chat else body.get("max_tokens")
    if n is not None:
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"max_tokens={n!r} must be a positive integer")
        out["max_new_tokens"] = n
    for key in ("temperature", "top_p"):
        v = body.get(key)
        if v is not None:
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                raise ValueError(f"{key}={v!r} must be a number")
            out[key] = float(v)
    if body.get("seed") is not None:
        if not isinstance(body["seed"], int):
            raise ValueError(f"seed={body['seed']!r} must be an integer")
        out["seed"] = body["seed"]
    stop = body.get("stop")
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise ValueError("stop must be a string or a list of strings")
        out["stop"] = stop
    if body.get("n", 1) != 1:
        raise ValueError("n must be 1: one choice per request")
    return out


def make_app(gen: Generator, model: str, api_key: str | None = None, budget: int | None = None) -> Starlette:
    created = int(time.time())

    def authorized(request: Request) -> bool:
        return api_key is None or request.headers.get("authorization", "") == f"Bearer {api_key}"

    async def health(request: Request):
        if gen.error and gen.llm is None:
            return JSONResponse({"status": "error", "error": gen.error}, status_code=500)
        if not gen.ready.is_set():
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse({"status": "ok", "model": model, "queued": gen.jobs.qsize(), "busy": gen.busy})

    async def models(request: Request):
        if not authorized(request):
            return _error(401, "a valid API key is needed: Authorization: Bearer <key>", "authentication_error")
        return JSONResponse({"object": "list", "data": [{"id": model, "object": "model", "created": created,
                                                         "owned_by": "cadence"}]})

    async def metrics(request: Request):
        m, llm = gen.stats, gen.llm
        lines = []

        def metric(name, kind, help_, value):
            lines.extend([f"# HELP cadence_{name} {help_}", f"# TYPE cadence_{name} {kind}", f"cadence_{name} {value}"])

        metric("requests_total", "counter", "Generation requests accepted", m.requests)
        metric("requests_rejected_total", "counter", "Requests refused with 429: the queue was full", m.rejected)
        metric("requests_cancelled_total", "counter", "Generations stopped because their client went away", m.cancelled)
        metric("generated_tokens_total", "counter", "Tokens generated", m.tokens)
        metric("prompt_tokens_total", "counter", "Prompt tokens processed", m.prompt_tokens)
        metric("queue_depth", "gauge", "Requests waiting for the generation thread", gen.jobs.qsize())
        metric("tokens_per_second", "gauge", "Tokens per second of the last generation", m.last_tokens_per_s)
        metric("accepted_per_verification", "gauge", "Draft tokens the target accepted per verification, since start",
               round(m.accepted / m.verifications, 4) if m.verifications else 0)
        metric("disk_read_gbps", "gauge", "Weight bytes read from disk per second of read time, since start",
               round(m.bytes_read / m.read_s / 1e9, 4) if m.read_s else 0)
        metric("disk_read_bytes_total", "counter", "Weight bytes read from disk", m.bytes_read)
        if budget:
            metric("memory_budget_bytes", "gauge", "The memory budget the run was planned for", budget)
        if llm is not None and llm.plan is not None:
            metric("memory_planned_bytes", "gauge", "What the plan expects the processes to hold", llm.plan.held)
        held = _held_bytes(llm)
        if held:
            metric("memory_held_bytes", "gauge", "What the run's processes hold now (PSS: anonymous and shared)", held)
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    async def completions(request: Request):
        return await _generate(request, chat=False)

    async def chat_completions(request: Request):
        return await _generate(request, chat=True)

    async def _generate(request: Request, chat: bool):
        if not authorized(request):
            return _error(401, "a valid API key is needed: Authorization: Bearer <key>", "authentication_error")
        if not gen.ready.is_set():
            return _error(503, "the models are still loading; retry in a few seconds", "server_error")
        if gen.llm is None:
            return _error(500, f"the models failed to load: {gen.error}", "server_error")
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "the body must be a JSON object")
        if not isinstance(body, dict):
            return _error(400, "the body must be a JSON object")
        try:
            params = _params(body, chat)
            if chat:
                payload = body.get("messages")
                if not isinstance(payload, list) or not payload or not all(
                        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                        for m in payload):
                    raise ValueError('messages must be a non-empty list of {"role", "content"} objects with text content')
                payload = [{"role": m["role"], "content": m["content"]} for m in payload]
            else:
                payload = body.get("prompt")
                if isinstance(payload, list) and len(payload) == 1 and isinstance(payload[0], str):
                    payload = payload[0]
                if not isinstance(payload, str):
                    raise ValueError("prompt must be a string (one prompt per request)")
        except ValueError as e:
            return _error(400, str(e))
        job = Job(chat, payload, params, asyncio.get_running_loop())
        try:
            gen.jobs.put_nowait(job)
        except queue.Full:
            gen.stats.rejected += 1
            return _error(429, f"{gen.jobs.maxsize} requests are waiting already; retry later", "rate_limit_error")
        gen.stats.requests += 1
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        if body.get("stream"):
            return EventSourceResponse(_events(job, rid, chat, bool((body.get("stream_options") or {}).get("include_usage"))),
                                       ping=15, send_timeout=30)
        return await _whole(request, job, rid, chat)

    async def _whole(request: Request, job: Job, rid: str, chat: bool):
        text = ""
        while True:
            try:
                kind, value = await asyncio.wait_for(job.out.get(), timeout=0.25)
            except asyncio.TimeoutError:
                if await request.is_disconnected():  # the client left: stop its generation
                    job.cancelled.set()
                continue
            if kind == "piece":
                text += value
            elif kind == "error":
                return _error(500, value, "server_error")
            elif kind == "cancelled":
                return _error(499, "the client closed the request", "cancelled")
            else:
                done = value if kind == "done" else None
                text = done.text if done is not None else value
                finish = done.finish_reason if done is not None else "stop"
                usage = _usage(done, text)
                choice = {"index": 0, "finish_reason": finish, "logprobs": None}
                if chat:
                    choice["message"] = {"role": "assistant", "content": text}
                else:
                    choice["text"] = text
                return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                                     "created": int(time.time()), "model": model, "choices": [choice], "usage": usage})

    async def _events(job: Job, rid: str, chat: bool, include_usage: bool):
        kind_name = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: str | None, finish: str | None = None, role: bool = False):
            c = {"index": 0, "finish_reason": finish, "logprobs": None}
            if chat:
                c["delta"] = ({"role": "assistant"} if role else {}) | ({"content": delta} if delta is not None else {})
            else:
                c["text"] = delta or ""
            return json.dumps({"id": rid, "object": kind_name, "created": int(time.time()), "model": model, "choices": [c]})

        try:
            if chat:
                yield {"data": chunk("", role=True)}
            while True:
                kind, value = await job.out.get()
                if kind == "piece":
                    if value:
                        yield {"data": chunk(value)}
                elif kind == "error":
                    yield {"data": json.dumps({"error": {"message": value, "type": "server_error", "code": 500}})}
                    return
                elif kind == "cancelled":
                    return
                else:
                    finish = value.finish_reason if kind == "done" else "stop"
                    yield {"data": chunk(None, finish)}
                    if include_usage:
                        usage = _usage(value if kind == "done" else None, "")
                        yield {"data": json.dumps({"id": rid, "object": kind_name, "created": int(time.time()),
                                                   "model": model, "choices": [], "usage": usage})}
                    yield {"data": "[DONE]"}
                    return
        finally:
            job.cancelled.set()  # a client that left mid-stream (or any end): its generation stops at the next cycle

    return Starlette(routes=[
        Route("/health", health), Route("/metrics", metrics), Route("/v1/models", models),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ])


def _usage(done, text: str) -> dict:
    if done is None:
        return {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    n = len(done.token_ids)
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": n, "total_tokens": done.prompt_tokens + n}


def _held_bytes(llm) -> int:
    """PSS (anonymous + shared) of this process and the run's actors now: what the run holds."""
    return llm.held_bytes() if llm is not None else 0
