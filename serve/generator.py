"""The one thread that owns the models: it loads them, then runs the generations from a bounded queue through the
run's batch: one at a time, or with `--parallel N` up to N together (speculative/batch.py: each joins at the next
cycle as a slot frees, every cycle's trees verified in one forward). A job's pieces go back to its request's event loop; a client that
goes away sets `cancelled`, and its generation stops at the next cycle boundary (where the models agree with the
text), its slot free at once."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import secrets
import threading
import time
from dataclasses import dataclass, field

from common.errors import CadenceError, PromptError
from common.settings import SamplingConfig
from serve.requests import Ask
from speculative.batch import NoRoom

log = logging.getLogger("cadence.serve")


@dataclass
class Job:
    """One request's generation: what to run, where its events go, whether its client left. Events:
    ("piece", text), ("done", Completion), ("stopped", text) at a stop string, ("cancelled", None),
    ("client_error", PromptError), ("error", message)."""

    ask: Ask
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    tokens: int | None = None  # the tokens it generated, once done (the access log's)
    done: object = None  # its Completion, once done

    def put(self, kind: str, value=None) -> None:
        if kind == "done":
            self.tokens, self.done = len(value.token_ids), value
        self.loop.call_soon_threadsafe(self.out.put_nowait, (kind, value))


@dataclass
class Metrics:
    requests: int = 0
    rejected: int = 0  # 429: the queue was full
    cancelled: int = 0
    tokens: int = 0
    prompt_tokens: int = 0
    prompt_reused: int = 0  # prompt tokens whose KV rows were found cached (the slot's, or the prompt cache's)
    last_tokens_per_s: float = 0.0
    accepted: int = 0
    verifications: int = 0
    bytes_read: int = 0
    read_s: float = 0.0
    # the generation under way, chunk by chunk (the chat page's live figures): its tokens, the seconds since its
    # first chunk, its verifications and the draft tokens they accepted
    live_tokens: int = 0
    live_started: float = 0.0
    live_last: float = 0.0
    live_verifications: int = 0
    live_accepted: int = 0

    def start(self) -> None:
        self.live_tokens = self.live_verifications = self.live_accepted = 0
        self.live_started = self.live_last = 0.0

    def chunk(self, c) -> None:
        now = time.monotonic()
        if not self.live_started:
            self.live_started = now  # after the prompt's pass: the tokens per second of decoding
        else:
            self.live_tokens += len(c.tokens)
        self.live_last = now
        if c.accepted is not None:
            self.live_verifications += 1
            self.live_accepted += c.accepted

    @property
    def live_tokens_per_s(self) -> float:
        span = self.live_last - self.live_started
        return self.live_tokens / span if span > 0 else 0.0

    def record(self, c) -> None:
        self.tokens += len(c.token_ids)
        self.prompt_tokens += c.prompt_tokens
        self.prompt_reused += c.stats.get("reused_prompt_tokens", 0)
        self.last_tokens_per_s = c.tokens_per_s
        self.accepted += c.stats.get("accepted", 0)
        self.verifications += c.stats.get("verifications", 0)
        self.io(c.stats)

    def io(self, stats: dict) -> None:
        """A generation's reads, or a batch's (`Runner.take_io`: each cycle, where no row holds them)."""
        self.bytes_read += stats.get("bytes_read", 0)
        self.read_s += stats.get("read_s", 0.0)


class JobQueue(queue.Queue):
    """The requests waiting for a slot; one whose client left while it waited gives its place up at once."""

    def discard(self, job) -> bool:
        """Take `job` out if it still waits (then a 429 no longer counts it): whether it did."""
        with self.mutex:
            try:
                self.queue.remove(job)
            except ValueError:
                return False
            self.not_full.notify()
            return True


class Generator(threading.Thread):
    """Owns the model pair: loads it, then serves the jobs of a bounded queue, as many at once as the batch has slots."""

    def __init__(self, make_llm, queue_size: int):
        super().__init__(name="cadence-generator", daemon=True)
        self.make_llm, self.jobs = make_llm, JobQueue(maxsize=queue_size)
        self.llm = None
        self.error: str | None = None
        self.ready = threading.Event()
        self.busy = 0  # generations under way
        self.slots: dict[int, int] = {}  # --parallel: a busy slot -> the tokens its generation has made
        self.stats = Metrics()
        self.on_chunk = None  # a watcher of every generation's chunks (the monitor's feed)

    def run(self) -> None:
        try:
            self.llm = self.make_llm()
        except Exception as e:  # noqa: BLE001 - /health and the command say it in one sentence
            self.error = str(e) if isinstance(e, CadenceError) else f"{type(e).__name__}: {e}"
            self.ready.set()
            return
        self.ready.set()
        try:
            self._serve()
        finally:
            self.llm.close()

    def _sampling(self, ask: Ask) -> SamplingConfig:
        """The server's sampling with what the request gave; a request that samples without a seed gets one of its
        own (as OpenAI's and llama-server's do), so two such requests do not write the same text."""
        given = dict(ask.sampling)
        if "seed" not in given and given.get("temperature", self.llm.plan.sampling.temperature) > 0:
            given["seed"] = secrets.randbits(63)
        return dataclasses.replace(self.llm.plan.sampling, **given)

    def _serve(self) -> None:
        """Jobs join the batch (of `--parallel` slots, or of one) as slots free, between cycles; each cycle moves
        every one of them."""
        runner = self.llm.runner
        batch = runner.batch()
        live: dict[int, list] = {}  # id(job) -> [job, the text so far, its slot]
        stopping, held = False, None  # held: the job the KV pool had no room for, first to join when one ends
        while True:
            while not stopping and batch.free:
                try:
                    job, held = held or self.jobs.get(block=not live), None  # idle: wait for a request
                except queue.Empty:
                    break
                if job is None:
                    stopping = True
                    break
                if job.cancelled.is_set():  # its client left as the slot freed
                    self.stats.cancelled += 1
                    job.put("cancelled")
                    continue
                try:
                    runner.join(id(job), job.ask.prompt, None, job.ask.max_new_tokens, self._sampling(job.ask))
                except NoRoom as e:
                    if live:  # it joins first when one of them ends
                        held = job
                        break
                    # nothing will end to make room (an empty pool holds what `prepare` lets in)
                    job.put("error", str(e))
                    continue
                except PromptError as e:
                    job.put("client_error", e)
                    continue
                except CadenceError as e:
                    job.put("error", str(e))
                    continue
                if not live:
                    self.stats.start()
                live[id(job)] = [job, "", batch.gens[id(job)].slot]
            for key, (job, _, _) in list(live.items()):
                if job.cancelled.is_set():  # at a cycle boundary: the slot is free for the next request
                    self._end(runner, live, key)
                    self.stats.cancelled += 1
                    job.put("cancelled")
            self.busy = len(live)
            if not live:
                if stopping:
                    return
                continue
            try:
                outcomes = batch.cycle()
            except Exception as e:  # noqa: BLE001 - an actor died or failed: every request under way fails with it
                log.exception("generation failed")
                self.error = f"{type(e).__name__}: {e}"
                for key, (job, _, _) in list(live.items()):
                    self._end(runner, live, key)
                    job.put("error", self.error)
                continue
            self.stats.io(runner.take_io())  # the batch's reads: no generation's row holds them
            for key, outcome in outcomes:
                if key in live:
                    self._take(runner, live, key, runner.chunk(key, outcome))
            self.slots = {slot: self.slots.get(slot, 0) for _, _, slot in live.values()}
            self.busy = len(live)

    def _take(self, runner, live: dict, key: int, chunk) -> None:
        """A batch generation's chunk to its request: a piece, its end, a stop string, or its error."""
        job = live[key][0]
        if isinstance(chunk, CadenceError):
            del live[key]
            job.put(
                "client_error" if isinstance(chunk, PromptError) else "error",
                chunk if isinstance(chunk, PromptError) else str(chunk),
            )
            return
        self.stats.chunk(chunk)
        if self.on_chunk is not None:
            self.on_chunk(chunk)
        slot = live[key][2]
        self.slots[slot] = self.slots.get(slot, 0) + len(chunk.tokens)
        text = live[key][1] = live[key][1] + chunk.text
        if self._pass_on(job, text, chunk):  # a stop string, or its end
            if chunk.completion is None:
                self._end(runner, live, key)
            else:
                del live[key]
                self.slots.pop(slot, None)

    def _pass_on(self, job: Job, text: str, chunk) -> bool:
        """A chunk to its request (`text`: all so far): its piece, and where the generation ends (a stop string in
        the text, or its last chunk) how; whether it ended."""
        cut = stop_at(text, job.ask.stop)
        if cut is not None:  # a stop string: the text up to it, and the generation ends here
            job.put("piece", chunk.text[: max(0, len(chunk.text) - (len(text) - cut))])
            job.put("stopped", text[:cut])
            return True
        if chunk.text:
            job.put("piece", chunk.text)
        if chunk.completion is not None:
            self.stats.record(chunk.completion)
            job.put("done", chunk.completion)
            return True
        return False

    def _end(self, runner, live: dict, key: int) -> None:
        _, _, slot = live.pop(key)
        self.slots.pop(slot, None)
        runner.leave(key)

    def left(self, job: Job) -> bool:
        """A client left: its generation stops at the next cycle, or, while it still waits for a slot, it gives
        its place up now and is counted (whether it was still waiting)."""
        job.cancelled.set()
        if self.jobs.discard(job):
            self.stats.cancelled += 1
            return True
        return False

    def stop(self) -> None:
        for job in list(self.jobs.queue):
            job.cancelled.set()
        try:
            self.jobs.put(None, timeout=5)
        except queue.Full:
            pass


def stop_at(text: str, stops: tuple[str, ...]) -> int | None:
    hits = [text.find(s) for s in stops if s in text]
    return min(hits) if hits else None
