"""The verifier actor: the target model scoring a whole token tree in one pass (speculative/verify.py).

Resident mode (`start`, `step`, `verify`): every target layer is in this process, one op a job,
answered with its result (`Token`, `Verdict`: actors/ops.py).
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

import torch

from actors.base import Actor, ActorContext
from actors.ops import AwaitExperts, AwaitGroup, Begin, Experts, Layer, Start, PlainStep, Token, Verify
from actors.executor import SplitExecutor
from actors.syncarea import Clock
from models.loading import load_store
from models.requests import NeedExperts, NeedWeights
from common.settings import SamplingConfig
from models.store import WeightStore, expert_group
from models.transformer import Transformer
from models.weights import StreamingWeights, weights_for
from speculative.sampling import trials_from_wire
from speculative.tree import TokenTree, Verdict
from speculative.verify import Verifier

RESULTS = (Token, Verdict)  # what a job ends with


class VerifierActor(Actor):
    role = "verifier"

    def __init__(self, init: dict, ctx: ActorContext):
        super().__init__(init, ctx)
        torch.set_num_threads(int(init.get("threads") or torch.get_num_threads()))
        self.streaming = init.get("resident") is not None
        with self.trace.span("load target", cat="setup"):
            if self.streaming:
                store = WeightStore(init["store"])
                self.weights = StreamingWeights(store, set(init["resident"]))
                self.model = Transformer(store.args, self.weights)
                moe = init.get("experts") or {}  # {"batch": experts per request, "lookahead": bool}
                self.model.expert_batch = int(moe.get("batch") or 0)
                self.model.lookahead = bool(moe.get("lookahead"))
            else:
                self.model = load_store(init["store"], init.get("name", "")).model
                self.weights = self.model.weights
        worker = init.get(
            "worker"
        )  # {"share": dense share, "columns": column share} given to the sparse worker, or None
        self.executor = None
        if worker is not None:
            self.executor = SplitExecutor(
                self.model, float(worker["share"]), float(worker.get("columns") or 0.0), self.trace
            )
        self.sampling = SamplingConfig(**init["sampling"])
        self.verifier = None
        self.job = None  # job mode: the job under way (a generator) and what it waits for
        self.need = None
        self.kind = None

    # -- resident ---------------------------------------------------------------------------

    def op_start(self, args: Start, tensors):
        """Prefill the prompt; the first token."""
        self.verifier = self._verifier(args)
        token = self.verifier.start(list(args.prompt_ids), args.capacity)
        return Token(token, self.verifier.reused)

    def _verifier(self, args: Start) -> Verifier:
        """A generation's verifier: the last one's cache kept for a prompt that continues it, unless told not to."""
        return Verifier(self.model, self._sampling(args), previous=self.verifier if args.reuse else None)

    def _sampling(self, args: Start) -> SamplingConfig:
        """A generation's own sampling (a server's request), or the run's."""
        return SamplingConfig(**args.sampling) if args.sampling else self.sampling

    def op_step(self, args: PlainStep, tensors):
        """A plain decode step on the root."""
        return Token(self.verifier.step(args.root))

    def op_verify(self, args: Verify, tensors):
        return self.verifier.verify_tree(*self._tree(args, tensors))

    def _tree(self, args: Verify, tensors):
        tree = TokenTree.of(args)
        trials = None
        if args.trials is not None:
            dists = self.tensor(tensors["dists"]) if "dists" in tensors else None
            trials = trials_from_wire(args.trials, dists)
        return tree, trials

    # -- streaming --------------------------------------------------------------------------

    def op_begin(self, args: Begin, tensors):
        """Start a job (its payload: Start, PlainStep or Tree in `args.args`), with `split` {"id", "rows", "timeout_s"}
        when the sparse worker serves it."""
        if self.job is not None:
            raise RuntimeError(f"a {self.kind} job is still waiting for {self._waits_for()}")
        kind, job_args = args.job, args.job_payload()
        planner = None
        if args.split is not None:
            sp = args.split
            clock = Clock(
                "the sparse worker", float(sp["timeout_s"]), self.interrupted, self.beat, self.ctx.heartbeat_s
            )
            slots = {k: self.tensor(v) for k, v in tensors.items() if k in ("sync", "q", "ch", "x", "xin", "y")}
            self.executor.begin(int(sp["id"]), int(sp["rows"]), slots, clock)
            planner = self.executor.plan
        try:
            if kind == "start":
                self.verifier = self._verifier(job_args)
                kv = self.tensor(tensors["kv"]) if "kv" in tensors else None
                job = self.verifier.start_steps(list(job_args.prompt_ids), job_args.capacity, kv, planner)
            elif kind == "step":
                job = self.verifier.step_steps(job_args.root)
            else:
                job = self.verifier.verify_steps(*self._tree(job_args, tensors), planner)
        except BaseException:
            self._fail()
            raise
        self.job, self.kind = job, kind
        return self._advance(None)

    def op_experts(self, args: Experts, tensors):
        """The experts the job waits for, each in a slot of the expert buffer (mapped, not copied)."""
        need = self.need
        if (
            self.job is None
            or not isinstance(need, NeedExperts)
            or list(need.experts) != list(args.experts)
            or need.layer != args.layer
        ):
            raise RuntimeError(
                f"experts {args.experts} of layer {args.layer} arrived but the verifier waits for {self._waits_for()}"
            )
        with self.trace.span(f"compute:experts.{args.layer}", cat="verify", args={"experts": len(args.experts)}):
            r = self._send(
                {
                    e: self.weights.from_buffer(expert_group(args.layer, e), self.tensor(tensors[f"e{e}"]))
                    for e in args.experts
                }
            )
        return r if isinstance(r, RESULTS) else self._advance(r)

    def _waits_for(self) -> str:
        if self.job is None:
            return "nothing"
        n = self.need
        return f"experts {list(n.experts)} of layer {n.layer}" if isinstance(n, NeedExperts) else n.group

    def op_layer(self, args: Layer, tensors):
        """The streamed group the job waits for, in an arena slot (mapped, not copied)."""
        group = args.group
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
        if kind == "verify":
            return value
        return Token(value, self.verifier.reused if kind == "start" else 0)
