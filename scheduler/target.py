"""The target behind the actors: one verifier job (start / step / verify), run by the verifier actor
with the layers the loader streams in and the splits the sparse-attention worker takes."""
from __future__ import annotations

import time

from cadence.settings import TreeConfig
from scheduler.errors import ActorDead, ActorError, RequestTimeout
from scheduler.events import DeadEvent, ReplyEvent
from scheduler.runtime import Scheduler


class ActorTarget:
    def __init__(self, sched: Scheduler, streamer, worker: dict | None, model_args: dict | None, cfg: TreeConfig):
        self.s, self.streamer, self.worker, self.model_args, self.cfg = sched, streamer, worker, model_args, cfg
        self.kv_slot = self.job_slots = self.col_slots = None

    def run(self, job: str, args: dict, tensors: dict | None = None) -> dict:
        """A verifier job (start / step / verify): one op, or a conversation when layers stream in
        from the loader or attention is split with the sparse worker."""
        s = self.s
        if self.streamer is None and self.worker is None:
            return s.call("verifier", job, args, tensors).result
        tensors = dict(tensors or {})
        if self.worker is not None:
            tensors.update(self._worker_slots(job, args))
        if self.streamer is not None:
            self.streamer.refill()
        r = s.call("verifier", "begin", {"job": job, **args}, tensors).result
        while "need" in r:
            if r["need"] == "attn":
                r = self._split_attention(r)
            elif r["need"] == "cols":
                r = self._split_columns(r)
            else:
                r = self.streamer.feed(r["need"])
        return r["done"]

    def _worker_slots(self, job: str, args: dict) -> dict:
        """Arena room for Q and the worker's chunk states, and at each prompt the KV cache itself."""
        s, a = self.s, self.model_args
        out = {}
        if self.job_slots is None:
            rows = max(256, self.cfg.budget + 1)  # a prefill chunk, or a tree with its root
            maxc = -(-(rows + 2 * 32) // 32)
            q = s.slots.alloc(rows * a["n_heads"] * a["head_dim"] * 4)
            ch = s.slots.alloc(rows * a["n_heads"] * maxc * (a["head_dim"] + 2) * 4)
            self.job_slots = (q, ch)
            if self.worker.get("columns"):  # column split: the residual stream, the linears' inputs and outputs
                q_dim, kv_dim = a["n_heads"] * a["head_dim"], a["n_kv_heads"] * a["head_dim"]
                self.col_slots = tuple(s.slots.alloc(rows * n * 4) for n in (
                    a["dim"], max(a["dim"], q_dim, a["ffn_dim"]), max(q_dim + 2 * kv_dim, 2 * a["ffn_dim"])))
        q, ch = self.job_slots
        out["q"], out["ch"] = s.slot_desc(q), s.slot_desc(ch)
        if self.col_slots:
            out.update(zip(("x", "xin", "y"), map(s.slot_desc, self.col_slots)))
        if job == "start":
            if self.kv_slot is not None:
                s.slots.free(self.kv_slot)
            cap = int(args["capacity"])
            self.kv_slot = s.slots.alloc(2 * a["n_layers"] * a["n_kv_heads"] * cap * a["head_dim"] * 4)
            out["kv"] = s.slot_desc(self.kv_slot)
            s.call("sparse", "bind", {"capacity": cap}, {"kv": out["kv"]})
        return out

    def _split_attention(self, need: dict) -> dict:
        """The worker computes its chunks while the verifier folds its own; then the verifier merges."""
        s = self.s
        q, ch = self.job_slots
        wargs = {k: need[k] for k in ("layer", "T", "n_shared", "ptr", "idx", "k0", "maxc", "scale") if k in need}
        rid_w = s.send("sparse", "attend", wargs, {"q": s.slot_desc(q), "out": s.slot_desc(ch)})
        got = self._both(rid_w, "attend", s.send("verifier", "dense", {}), "dense")
        return s.call("verifier", "merge", {"maxc": need["maxc"], "nch": got["nch"]}).result

    def _split_columns(self, need: dict) -> dict:
        """The worker writes its columns of one linear layer while the verifier writes its own; then on."""
        s = self.s
        x, xin, y = self.col_slots
        wargs = {k: need[k] for k in ("layer", "name", "T", "acc", "n0")}
        rid_w = s.send("sparse", "cols", wargs, {"xin": s.slot_desc(xin), "out": s.slot_desc(x if need["acc"] else y)})
        self._both(rid_w, "cols", s.send("verifier", "cols", {}), "cols")
        return s.call("verifier", "cols_done", {}).result

    def _both(self, rid_w: int, op_w: str, rid_v: int, op_v: str) -> dict:
        """Wait for the worker's and the verifier's replies to two requests running at once; the worker's result."""
        s = self.s
        replies = {}
        deadline = time.monotonic() + s.config.timeouts.request_s
        while len(replies) < 2:
            if time.monotonic() > deadline:
                raise RequestTimeout("sparse", op_w, rid_w, s.config.timeouts.request_s)
            for ev in s.poll(0.05):
                if isinstance(ev, ReplyEvent) and ev.reply.req_id in (rid_w, rid_v):
                    if not ev.reply.ok:
                        who, op = ("sparse", op_w) if ev.reply.req_id == rid_w else ("verifier", op_v)
                        raise ActorError(who, op, ev.reply.req_id, ev.reply.error)
                    replies[ev.reply.req_id] = ev.reply.result
                elif isinstance(ev, DeadEvent):
                    raise ActorDead(ev.role, ev.reason)
                elif self.streamer is not None:
                    self.streamer.on_events([ev])
        return replies[rid_w]

    def close(self):
        for slot in (self.kv_slot, *(self.job_slots or ()), *(self.col_slots or ())):
            if slot is not None:
                self.s.slots.free(slot)
        self.kv_slot = self.job_slots = self.col_slots = None
