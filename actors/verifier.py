"""The verifier actor: the target model scoring a whole token tree in one pass (speculative/verify.py).

Resident mode (`start`, `step`, `verify`): every target layer is in this process, one op a job,
answered with its result (`Token`, `Verdict`: actors/calls.py).
Job mode (`begin`, then `layer` or `experts`, until the result), used under a memory budget and with
the sparse-attention worker: a job (`start`, `step` or `verify`) runs until it needs a streamed group,
`AwaitGroup("layer.7")`; the scheduler has the loader put it into an arena slot and hands it over
with `layer`. A mixture of experts under a budget also asks for the experts a layer's tokens route
to, `AwaitExperts(7, [...], guess)`, answered by `experts` with their slots in the expert buffer
(scheduler/generation/experts.py). With the worker (`begin` carries `split`: the job's id, its rows and the wait
timeout), the split executor (actors/executor.py) plans each forward and meets the worker, which
serves the same job, in the arena's sync area: no message per layer.
"""

from __future__ import annotations

import dataclasses

import torch

from actors.base import Actor, ActorContext
from actors.calls import AwaitExperts, AwaitGroup, Batched, Token, record, signature
from actors.executor import SplitExecutor
from actors.starts import VerifierStart
from actors.syncarea import Clock
from formats.loading import load_store
from models.requests import NeedExperts, NeedWeights
from common.settings import SamplingConfig
from formats.store import WeightStore, expert_group
from models.transformer import Transformer
from formats.weights import StreamingWeights
from models.requests import drive, weights_for
from speculative.tree import TokenTree, Tree, Verdict
from speculative.prefixes import prompt_cache
from speculative.slots import Slots
from speculative.verify import Prefill, Verifier, many_steps

RESULTS = (Token, Verdict, Batched)  # what a job ends with
JOBS = ("start", "step", "verify", "batch")  # what `begin` starts: the resident ops, run a streamed group at a time


class VerifierActor(Actor):
    role = "verifier"

    def __init__(self, init: dict, ctx: ActorContext):
        super().__init__(init, ctx)
        start = record(VerifierStart, init, "the verifier's start")
        torch.set_num_threads(start.threads or torch.get_num_threads())
        self.streaming = start.resident is not None
        with self.trace.span("load target", cat="setup"):
            if self.streaming:
                store = WeightStore(start.store)
                self.weights = StreamingWeights(store, set(start.resident))
                self.model = Transformer(store.args, self.weights)
                if start.experts is not None:  # a request for experts never asks for more than the buffer holds
                    self.model.expert_batch = start.experts.batch
                    self.model.lookahead = start.experts.lookahead
            else:
                self.model = load_store(start.store, start.name).model
                self.weights = self.model.weights
        self.model.kv_dtype = start.kv_dtype  # its caches' keys and values (--kv-dtype)
        self.executor = None
        if start.worker is not None:  # the dense share and the column share given to the sparse worker
            self.executor = SplitExecutor(self.model, start.worker.share, start.worker.columns, self.trace)
        self.sampling = start.sampling
        self.verifier = None
        pc = None if start.prompt_cache is None else dataclasses.asdict(start.prompt_cache)
        self.prefixes = prompt_cache(pc, start.store, self.model.kv_dtype)  # or None
        self.batch = Slots(self.model, self.prefixes)  # a batch of generations (op `batch`): each slot's verifier
        self.job = None  # job mode: the job under way (a generator) and what it waits for
        self.need = None
        self.kind = None

    # -- resident ---------------------------------------------------------------------------

    def op_start(self, prompt_ids: list, capacity: int, sampling: dict | None = None, reuse: bool = True):
        """Prefill the prompt (the cache keeps the prefix the last generation shares with it, unless `reuse` is
        false: a benchmark's modes each pay their own prefill); the first token. `sampling`: this generation's
        (a server's request), else the run's."""
        self.verifier = self._verifier(sampling, reuse, self.verifier)
        token = self.verifier.start(list(prompt_ids), capacity)
        return Token(token, self.verifier.reused)

    def _verifier(self, sampling: dict | None, reuse: bool, previous: Verifier | None) -> Verifier:
        """A generation's verifier: the last one's cache (`previous`: of this slot) kept for a prompt that continues
        it, unless told not to."""
        return Verifier(
            self.model, self._sampling(sampling), previous if reuse else None, self.prefixes if reuse else None
        )

    def _sampling(self, sampling: dict | None) -> SamplingConfig:
        return SamplingConfig(**sampling) if sampling else self.sampling

    def op_step(self, root: int):
        """A plain decode step on the root."""
        return Token(self.verifier.step(root))

    def op_verify(self, tree: Tree):
        """Verify a token tree (what the draft's `cycle` answers)."""
        return self.verifier.verify_tree(TokenTree.of(tree))

    # -- a batch of generations ---------------------------------------------------------------

    def op_batch(self, calls: list):
        """Several generations' calls, one each (speculative/batch.py): {"slot", "kind" (start, step or verify),
        "args" (that op's arguments)}; the prefills one by one, then every step and verification in one forward
        (speculative/verify.py `many_steps`: a streamed layer read once for all)."""
        return drive(self._batch_steps(calls), self.weights)

    def op_logprobs(self, slot: int = -1):
        """The log-probabilities of the tokens the generation (a batch's `slot`'s) chose since the last ask."""
        v = self.batch.verifiers.get(slot) if slot >= 0 else self.verifier
        return v.take_logprobs() if v is not None else {"logprobs": []}

    def op_release(self, slot: int):
        """A batch's generation was cancelled: its slot's cache goes."""
        self.batch.verifiers.pop(slot, None)
        return {}

    def _batch_steps(self, calls: list):
        jobs = []
        for c in calls:
            slot, kind, a = int(c["slot"]), c["kind"], c["args"]
            if kind == "start":
                prompt, capacity = list(a["prompt_ids"]), int(a["capacity"])
                sampling, reuse = self._sampling(a.get("sampling")), a.get("reuse", True)
                v = self.batch.begin(slot, prompt, capacity, sampling, reuse, a.get("placed"))
                jobs.append((v, Prefill(prompt, capacity)))
            elif slot not in self.batch.verifiers:
                raise ValueError(f"slot {slot} has no generation; start one there first")
            elif kind == "step":
                jobs.append((self.batch.verifiers[slot], int(a["root"])))
            elif kind == "verify":
                jobs.append((self.batch.verifiers[slot], TokenTree.of(Tree(**a["tree"]))))
            else:
                raise ValueError(f"a batch takes start, step and verify calls, not {kind!r}")
        done = yield from many_steps(jobs)
        out = []
        for (v, what), r in zip(jobs, done):
            if isinstance(what, Prefill):  # None: its prompt has chunks still to prefill
                out.append(None if r is None else [r, v.reused])
            else:
                out.append([list(r.path), r.next_token] if isinstance(r, Verdict) else r)
        return Batched(out)

    # -- streaming --------------------------------------------------------------------------

    def op_begin(self, job: str, args: dict, tensors: dict, split: dict | None = None):
        """Job mode (streamed layers, the sparse worker): start `job` (start, step or verify) with `args`, the
        arguments that op takes in resident mode; the verifier answers with what it needs next (`AwaitGroup`,
        `AwaitExperts`) or, at the job's end, its result (`Token`, `Verdict`). `split` {"id", "rows",
        "timeout_s"}: the sparse worker serves this job (actors/executor.py)."""
        if self.job is not None:
            raise RuntimeError(f"a {self.kind} job is still waiting for {self._waits_for()}")
        if job not in JOBS:
            raise ValueError(f"unknown job {job!r}; use start, step or verify")
        kind, a = job, signature(getattr(type(self), "op_" + job), job).bind(args, tensors)
        planner = None
        if split is not None:
            sp = split
            clock = Clock(
                "the sparse worker", float(sp["timeout_s"]), self.interrupted, self.beat, self.ctx.heartbeat_s
            )
            slots = {k: self.tensor(v) for k, v in tensors.items() if k in ("sync", "q", "ch", "x", "xin", "y")}
            self.executor.begin(int(sp["id"]), int(sp["rows"]), slots, clock)
            planner = self.executor.plan
        try:
            if kind == "start":
                self.verifier = self._verifier(a.get("sampling"), a.get("reuse", True), self.verifier)
                kv = self.tensor(tensors["kv"]) if "kv" in tensors else None
                steps = self.verifier.start_steps(list(a["prompt_ids"]), a["capacity"], kv, planner)
            elif kind == "step":
                steps = self.verifier.step_steps(a["root"])
            elif kind == "batch":
                steps = self._batch_steps(a["calls"])
            else:
                steps = self.verifier.verify_steps(TokenTree.of(a["tree"]), planner)
        except BaseException:
            self._fail()
            raise
        self.job, self.kind = steps, kind
        return self._advance(None)

    def op_experts(self, layer: int, experts: list, tensors: dict):
        """The experts of MoE layer `layer` the job waits for, each in a slot of the expert buffer,
        `tensors["e<id>"]` (mapped, not copied)."""
        need = self.need
        if (
            self.job is None
            or not isinstance(need, NeedExperts)
            or list(need.experts) != list(experts)
            or need.layer != layer
        ):
            raise RuntimeError(
                f"experts {experts} of layer {layer} arrived but the verifier waits for {self._waits_for()}"
            )
        with self.trace.span(f"compute:experts.{layer}", cat="verify", args={"experts": len(experts)}):
            r = self._send(
                {e: self.weights.from_buffer(expert_group(layer, e), self.tensor(tensors[f"e{e}"])) for e in experts}
            )
        return r if isinstance(r, RESULTS) else self._advance(r)

    def _waits_for(self) -> str:
        if self.job is None:
            return "nothing"
        n = self.need
        return f"experts {list(n.experts)} of layer {n.layer}" if isinstance(n, NeedExperts) else n.group

    def op_layer(self, group: str, tensors: dict):
        """The streamed group the job waits for, in the arena slot `tensors["slot"]` (mapped, not copied)."""
        if self.job is None or not isinstance(self.need, NeedWeights) or group != self.need.group:
            raise RuntimeError(f"layer {group} arrived but the verifier waits for {self._waits_for()}")
        with self.trace.span(f"compute:{group}", cat="verify", args={"group": group}):
            r = self._send(self.weights.from_buffer(group, self.tensor(tensors["slot"])))
        return r if isinstance(r, RESULTS) else self._advance(r)  # resident layers after it count as their own work

    def _send(self, weights):
        """Hand the job what it waited for: its next request, or (at its end) the reply."""
        try:
            return self.job.send(weights)
        except StopIteration as done:
            return self._done(done.value)
        except BaseException:
            self._fail()
            raise

    def _resident(self, need: NeedWeights) -> bool:
        return not self.streaming or self.weights.is_resident(need)

    def _advance(self, need):
        """Feed the job resident layers and the executor's split answers until it needs a streamed group,
        or ends. `need` None: the job's first request."""
        try:
            need = next(self.job) if need is None else need
            while True:
                if not isinstance(need, (NeedWeights, NeedExperts)):
                    need = self.job.send(self.executor.answer(need))
                elif self._resident(need):
                    need = self.job.send(weights_for(self.weights, need))
                else:
                    break
        except StopIteration as done:
            return self._done(done.value)
        except BaseException:
            self._fail()
            raise
        self.need = need
        if isinstance(need, NeedExperts):
            return AwaitExperts(need.layer, list(need.experts), list(need.guess))
        return AwaitGroup(need.group)

    def _fail(self):
        """The job failed: drop it, and let the worker stop waiting for it."""
        self.job, self.need = None, None
        if self.executor is not None:
            self.executor.abandon()

    def _done(self, value):
        kind, self.job, self.need = self.kind, None, None
        if self.executor is not None:
            self.executor.end()
        if kind in ("verify", "batch"):
            return value
        return Token(value, self.verifier.reused if kind == "start" else 0)
