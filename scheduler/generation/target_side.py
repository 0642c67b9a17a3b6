"""The target side of the speculation cycle over the wire (speculative/loop.py): one verifier job
(start / step / verify), run by the verifier actor with the layers the loader streams in and the
split the sparse-attention worker takes.

With the worker, a multi-row job is two requests sent at once: `begin` to the verifier and `serve`
to the worker. They meet layer by layer in the arena's sync area (actors/syncarea.py), never
through here; only streamed layers still come back (`AwaitGroup("layer.N")`). The worker replies
as the verifier ends the job. Should either die, a listener writes the job's id into the sync
area's stop word, so that the other stops waiting at once and the run ends with the real reason.
"""

from __future__ import annotations

import struct
import time
from dataclasses import asdict

from actors.calls import AwaitExperts, AwaitGroup, wire_args
from actors.syncarea import STOP, SyncArea
from common.settings import PREFILL_CHUNK, SamplingConfig, TreeConfig, WorkerSplit
from models.args import ModelArgs
from common.errors import CadenceError
from scheduler.errors import ActorDead, ActorError
from scheduler.events import DeadEvent, ReplyEvent
from scheduler.procs import DEAD
from scheduler.remote import Remote
from scheduler.runtime import Runtime
from speculative.sides import Proposal, Start, Step, Verify

SPLIT_SLOTS = ("sync", "q", "ch", "x", "xin", "y", "kv")  # what the worker maps of a job's tensors
WORKER_WAIT, VERIFIER_WAIT = 0.8, 2.0  # of timeouts.request_s: how long each side of a split waits for the other
WORKER_REPLY_S = 1.0  # after the verifier failed a job: how long the worker's own reason may take to arrive


class ActorTarget:
    def __init__(
        self,
        sched: Runtime,
        cfg: TreeConfig,
        model: ModelArgs,
        streamer=None,
        worker: WorkerSplit | None = None,
        experts=None,
        kv_dtype: str = "f32",
    ):
        """`streamer`: the loader's side of the layers that stream (scheduler/generation/streaming.py);
        `worker`: the sparse-attention worker's split; `experts`: a mixture of experts' buffer under a
        budget (scheduler/generation/experts.py). Each None where the run has none. `kv_dtype`: the caches'."""
        self.s, self.streamer, self.worker, self.model, self.cfg = sched, streamer, worker, model, cfg
        self.kv_dtype = kv_dtype
        self.verifier = Remote(sched, "verifier")  # the verifier actor's ops (actors/verifier.py)
        self.logprobs = False  # the generation under way asked for its tokens' log-probabilities
        self.experts = experts
        if experts is not None and streamer is not None:
            experts.on_events = streamer.on_events
        self.streamed = streamer is not None
        self.io_wait: float | None = None  # the verifier's measured share of a verification spent waiting for layers
        self.job_req = 0  # the verifier request that began the last job (a trace arrow points to it)
        self.kv_slot = self.job_slots = self.col_slots = None
        self.rows = max(PREFILL_CHUNK, cfg.budget + 1)  # a prefill chunk, or a tree with its root
        self.job_id = 0  # the last job the worker was asked to serve
        self.serving: dict[int, int] = {}  # serve request -> its job, until the reply
        self.failed: dict[int, str] = {}  # job -> the worker's error
        self.answered: list[int] = []  # serve requests whose replies are still queued in the scheduler
        if worker is not None:
            sched.add_listener(self._on_event)

    # -- the target side ---------------------------------------------------------------------------

    def start(
        self, prompt_ids: list[int], capacity: int, sampling: SamplingConfig, reuse: bool = True
    ) -> tuple[int, int]:
        r = self.run("start", dict(prompt_ids=prompt_ids, capacity=capacity, sampling=asdict(sampling), reuse=reuse))
        self.logprobs = sampling.logprobs >= 0
        return r.token, r.reused

    def step(self, root: int) -> int:
        return self.run("step", dict(root=root)).token

    def verify(self, p: Proposal) -> tuple[list[int], int]:
        s = self.s
        wait0, t = self._io_wait(), time.perf_counter()
        v = self.run("verify", dict(tree=p.tree))
        if (
            self.streamer is not None or self.experts is not None
        ):  # the share of a verification spent waiting for the loader
            share = (self._io_wait() - wait0) / max(time.perf_counter() - t, 1e-9)
            self.io_wait = share if self.io_wait is None else 0.7 * self.io_wait + 0.3 * share
        if p.req is not None:  # the arrow from the draft's tree to its verification
            s.trace.link((s.actors["draft"].pid, p.req), (s.actors["verifier"].pid, self.job_req), "draft tree", "tree")
        return list(v.path), v.next_token

    def _io_wait(self) -> float:
        return (self.streamer.stats.wait_s if self.streamer is not None else 0.0) + (
            self.experts.stats.wait_s if self.experts is not None else 0.0
        )

    def take_stats(self) -> dict:
        st = {}
        if self.streamer is not None:
            st = self.streamer.stats.as_dict()
            self.streamer.stats = type(self.streamer.stats)()
        if self.experts is not None:
            st.update(self.experts.take_stats())
        if self.logprobs:  # the generation's tokens' log-probabilities, kept by the verifier
            st.update(self.verifier.logprobs())
        return st

    # -- the conversation --------------------------------------------------------------------------

    def run(self, job: str, args: dict, tensors: dict | None = None, timeout: float | None = None):
        """A verifier job (start / step / verify / batch, with the arguments of that op) to its result (Token /
        Verdict / Batched): one op, or a conversation when layers stream in from the loader (`begin`); with the
        worker, it serves the job's split at the same time (a step has one row: nothing to split). `timeout`: for
        the whole op resident, for each reply streamed (default: the scheduler's)."""
        s = self.s
        if self.streamer is None and self.worker is None and self.experts is None:
            reply = self.verifier.call(job, tensors, timeout, **args)
            self.job_req = reply.req_id
            return reply.value
        tensors = dict(tensors or {})
        serving, split = None, None
        if self.worker is not None and job != "step":
            serving, split = self._serve(job, args, tensors)
            if job == "start":  # a resident prefill is one op however many chunks it has
                timeout = s.config.timeouts.request_s * (1 + len(args["prompt_ids"]) // PREFILL_CHUNK)
        if self.streamer is not None:
            self.streamer.refill()
        try:
            reply = self.verifier.call("begin", tensors, timeout, job=job, args=wire_args(args), split=split)
            self.job_req, r = reply.req_id, reply.value
            while isinstance(r, (AwaitGroup, AwaitExperts)):
                r = self._experts(r) if isinstance(r, AwaitExperts) else self.streamer.feed(r.group)
        except ActorError as e:
            if serving is not None and e.role == "verifier":
                self._blame_worker(*serving, e)
            raise
        return r

    def _experts(self, r: AwaitExperts):
        """Hand the verifier the experts it waits for, from the buffer; its reply (what it waits for next,
        or the job's result)."""
        tensors = self.experts.serve(r.layer, r.experts, r.guess)
        return self.verifier.experts(tensors, layer=r.layer, experts=r.experts)

    def _serve(self, job: str, args: dict, tensors: dict) -> tuple[tuple[int, int], dict]:
        """Send the worker its one request for this job; ((its request, the job's id), the verifier's split:
        `begin` gets the same slots and ids)."""
        s = self.s
        for rid in self.answered:  # the last jobs' replies: out of the scheduler's queue
            s.take_reply(rid)
        self.answered.clear()
        self.failed.clear()  # the last jobs' failures: over with them
        tensors.update(self._worker_slots(args.get("capacity") if job == "start" else None))
        self.job_id += 1
        # the verifier gives up on the worker's step before the scheduler gives up on the verifier, so the run
        # ends with the sentence that names the worker; the worker waits longer still (between its steps the
        # verifier may wait on the loader), so it never goes first
        limit = s.config.timeouts.request_s
        split = {"id": self.job_id, "rows": self.rows, "timeout_s": WORKER_WAIT * limit}  # begin's split
        rid = s.send(
            "sparse",
            "serve",
            dict(job=self.job_id, rows=self.rows, timeout_s=VERIFIER_WAIT * limit, capacity=args.get("capacity")),
            {k: tensors[k] for k in SPLIT_SLOTS if k in tensors},
        )
        self.serving[rid] = self.job_id
        return (rid, self.job_id), split

    def _worker_slots(self, capacity: int | None) -> dict:
        """Arena room for the sync area, Q and the worker's chunk states, the column split's buffers, and at
        each prompt (`capacity`: its KV cache's rows) the KV cache itself."""
        s, a = self.s, self.model
        out = {}
        if self.job_slots is None:
            rows = self.rows
            maxc = -(-(rows + 2 * 32) // 32)
            sizes = [SyncArea.nbytes(rows), rows * a.q_dim * 4, rows * a.n_heads * maxc * (a.head_dim + 2) * 4]
            if self.worker.columns:  # column split: the residual stream, the linears' inputs and outputs
                sizes += [
                    rows * n * 4
                    for n in (a.dim, max(a.dim, a.q_dim, a.ffn_dim), max(a.q_dim + 2 * a.kv_dim, 2 * a.ffn_dim))
                ]
            got = []
            try:
                for n in sizes:
                    got.append(s.slots.alloc(n))
            except BaseException:  # all or none: what was taken goes back before the error
                for slot in got:
                    s.slots.free(slot)
                raise
            sync = got[0]
            s.arena.buf[sync.offset : sync.offset + 256] = bytes(256)  # the sync words: no job seen yet
            self.job_slots, self.col_slots = tuple(got[:3]), tuple(got[3:]) or None
        out.update(zip(("sync", "q", "ch"), map(s.slot_desc, self.job_slots)))
        if self.col_slots:
            out.update(zip(("x", "xin", "y"), map(s.slot_desc, self.col_slots)))
        if capacity is not None:
            if self.kv_slot is not None:
                s.slots.free(self.kv_slot)
                self.kv_slot = None
            self.kv_slot = s.slots.alloc(a.kv_bytes(capacity, self.kv_dtype))
            out["kv"] = s.slot_desc(self.kv_slot)
        return out

    def _on_event(self, ev):
        """A listener (it sees every event, whoever polls): the worker's replies, and a death or a failure
        that must stop the job under way."""
        if isinstance(ev, ReplyEvent) and ev.reply.req_id in self.serving:
            job = self.serving.pop(ev.reply.req_id)
            self.answered.append(ev.reply.req_id)
            if not ev.reply.ok:
                self.failed[job] = ev.reply.error
                self._stop(job)
        elif isinstance(ev, DeadEvent) and ev.role in ("sparse", "verifier"):
            self._stop(self.job_id)

    def _stop(self, job: int):
        """Tell whoever still waits in the sync area that `job` is over."""
        if self.job_slots is not None and self.s.arena.buf is not None:
            struct.pack_into("<q", self.s.arena.buf, self.job_slots[0].offset + 8 * STOP, job)

    def _blame_worker(self, rid: int, job: int, err: ActorError):
        """The verifier failed a split job: when the worker died or failed first, that is the reason to give."""
        s, w = self.s, self.s.actors["sparse"]
        deadline = time.monotonic() + WORKER_REPLY_S
        while (
            err.error.startswith("Abandoned")
            and rid in self.serving
            and w.state != DEAD
            and time.monotonic() < deadline
        ):
            if s.take_reply(rid) is None:  # pumps: the listener hears the worker's reply, or its death
                time.sleep(0.005)
        if w.state == DEAD:
            raise ActorDead("sparse", w.reason) from err
        error = self.failed.pop(job, None)
        if error is not None and not error.startswith("Abandoned"):
            raise ActorError("sparse", "serve", rid, error) from err

    def close(self):
        if self.streamer is not None:
            self.streamer.drain()
        if self.experts is not None:
            self.experts.close()
        if self.worker is not None:
            self.s.remove_listener(self._on_event)
        for slot in (self.kv_slot, *(self.job_slots or ()), *(self.col_slots or ())):
            if slot is not None:
                self.s.slots.free(slot)
        self.kv_slot = self.job_slots = self.col_slots = None


class ActorBatch:
    """The target side of a batch of generations (speculative/batch.py) over the verifier actor: a verifier per slot
    there, and every slot's call of a cycle in one job (op `batch`), so that under a budget each streamed layer is
    read from disk once for every generation in the batch."""

    def __init__(self, target: ActorTarget):
        if target.worker is not None or target.experts is not None:
            raise CadenceError(
                "--parallel runs dense models without the sparse-attention worker; drop --sparse-attn, or run one "
                "prompt at a time"
            )
        self.target, self.s = target, target.s
        self.streamed = target.streamed
        self.logprobs: set[int] = set()  # the slots whose generations asked for log-probabilities

    def answer(self, calls: list) -> list:
        wire, links, starts = [], [], 0
        for slot, call in calls:
            if isinstance(call, Start):
                sampling = call.sampling
                args = dict(prompt_ids=call.prompt_ids, capacity=call.capacity, sampling=asdict(sampling))
                args["reuse"] = call.reuse
                (self.logprobs.add if sampling.logprobs >= 0 else self.logprobs.discard)(slot)
                if call.placed is not None:  # its range of the batch's KV pool (speculative/kvpool.py)
                    args["placed"] = list(call.placed)
                starts += 1 + len(call.prompt_ids) // PREFILL_CHUNK
            elif isinstance(call, Step):
                args = dict(root=call.root)
            else:
                p = call.proposal
                args = dict(tree=asdict(p.tree))
                if p.req is not None:
                    links.append(p.req)
            wire.append(dict(slot=slot, kind=call.op, args=args))
        limit = self.s.config.timeouts.request_s
        timeout = limit * (1 + starts) if self.target.streamer is None else None  # resident: prefills in the one op
        results = self.target.run("batch", dict(calls=wire), None, timeout).results
        s = self.s
        for req in dict.fromkeys(links):  # the arrows from the drafts' trees to the verification of them all
            s.trace.link(
                (s.actors["draft"].pid, req), (s.actors["verifier"].pid, self.target.job_req), "draft tree", "tree"
            )
        return [
            (None if r is None else tuple(r))
            if isinstance(c, Start)
            else (list(r[0]), r[1])
            if isinstance(c, Verify)
            else r
            for (_, c), r in zip(calls, results)
        ]

    def release(self, slot: int) -> None:
        self.target.verifier.release(slot=slot)

    def take_stats(self, slot: int) -> dict:
        """The generation's tokens' log-probabilities, where asked for (the loader's figures are the batch's, not a
        generation's: each generation's row leaves them out)."""
        return self.target.verifier.logprobs(slot=slot) if slot in self.logprobs else {}
