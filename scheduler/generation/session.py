"""A run's actors and the speculation cycle over them.

`ActorSession` starts the verifier (and the loader when layers stream, the sparse worker when
attention is split) and the draft, then builds the one speculation cycle (speculative/loop.py) with
its two sides over the wire: scheduler/generation/target_side.py for the verifier,
scheduler/generation/draft_side.py for the draft, or the trie alone in this process (`--draft none`).
`impl` swaps an actor class for another (the FAKE actors of the integration tests).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from actors.starts import DraftStart, ExpertRequests, FlashDraft, LoaderStart, SparseStart, VerifierStart
from common.modes import Mode
from common.settings import ExpertOptions, PromptCacheConfig, SamplingConfig, TreeConfig, WorkerSplit
from models.args import ModelArgs
from scheduler.generation.draft_side import ActorDraft
from scheduler.generation.target_side import ActorTarget
from scheduler.runtime import Runtime
from speculative.lookup import TrieDraft
from speculative.loop import Speculation

ACTORS = {
    "verifier": "actors.verifier:VerifierActor",
    "draft": "actors.draft:DraftActor",
    "loader": "actors.loader:LoaderActor",
    "sparse": "actors.sparse:SparseAttnActor",
}


@dataclass(frozen=True)
class SessionSpec:
    """What a run's actors are started with (engine/runner.py makes it from the run's configuration)."""

    mode: Mode
    target_store: str  # the weight store's directory
    model: ModelArgs  # the target's shape
    draft_store: str | None  # None: no draft model (a speculative mode then has the trie propose, here)
    sampling: SamplingConfig
    tree: TreeConfig
    threads: int
    context: int  # tokens a generation holds, prompt and answer (speculative/loop.py)
    plan: object = None  # a memory plan (scheduler/generation/memplan.py): stream what it does not keep resident
    worker: WorkerSplit | None = None  # the sparse-attention worker; verifier and worker then get a core each
    experts: ExpertOptions = ExpertOptions()  # a mixture of experts' buffer policies under a plan
    paths: object = None  # EdgeMoE's path statistics (scheduler/generation/expert_policy.py PathStats), or None
    draft_rows: int = 0  # FR-Spec under a plan: the draft's head keeps only this many token rows (0: all)
    flash: tuple[float, str, int] | None = None  # --draft flash: (FFN density, predictor, neurons a layer cached)
    prompt_cache: PromptCacheConfig | None = None  # the verifier's prompt cache (speculative/prefixes.py)
    kv_dtype: str = "f32"  # every KV cache's keys and values (--kv-dtype; models/kvcache.py)
    draft_kv_dtype: str | None = None  # the draft's (None: kv_dtype's)

    def __post_init__(self):
        object.__setattr__(self, "mode", Mode(self.mode))  # a mode's text (a test's, a message's) as the member


class ActorSession:
    def __init__(self, sched: Runtime, spec: SessionSpec, impl: dict[str, str] | None = None):
        """Spawn the actors `spec` needs (in parallel), then build the cycle's sides. `impl`: role ->
        "module:Class" to start instead of the real actor."""
        self.s, self.spec = sched, spec
        actors = {**ACTORS, **(impl or {})}
        self._spawn(sched, spec, actors)
        sched.wait_ready()
        plan, streamer, cache = spec.plan, None, None
        if "loader" in sched.actors:
            sizes = sched.call("loader", "groups").value.groups
            if plan.streamed:
                from scheduler.generation.streaming import Streamer

                streamer = Streamer(
                    sched, list(plan.streamed), {g: sizes[g] for g in plan.streamed}, prefetch=spec.mode is not Mode.STD
                )
            if plan.expert_buffer > 0:
                from scheduler.generation.experts import ExpertCache

                cache = ExpertCache(
                    sched,
                    {g: n for g, n in sizes.items() if g.startswith("expert.")},
                    spec.model.n_layers,
                    spec.model.n_experts,
                    spec.experts,
                    spec.paths,
                )
        self.target = ActorTarget(sched, spec.tree, spec.model, streamer, spec.worker, cache, spec.kv_dtype)
        self.loop = Speculation(
            self.target,
            self._draft(0),
            spec.mode,
            spec.tree,
            spec.sampling,
            spec.context,
            spec.model.context_length,
            counter=sched.tracer.counter,
        )

    def _draft(self, slot: int):
        """The draft side of a generation (`slot`: of a batch's), or None in a target-only mode."""
        spec = self.spec
        if not spec.mode.speculative:
            return None
        if spec.draft_store or spec.flash:
            return ActorDraft(self.s, slot)
        return TrieDraft(spec.tree.width, (spec.target_store, spec.model.vocab_size))

    def batch(self, slots: int):
        """Up to `slots` generations at once over these actors (speculative/batch.py `Lockstep`)."""
        from scheduler.generation.draft_side import propose_many
        from scheduler.generation.target_side import ActorBatch
        from speculative.batch import Lockstep

        args = self.spec.model
        kv = lambda rows: args.kv_bytes(rows, self.spec.kv_dtype) // 4  # noqa: E731
        return Lockstep(self.loop, ActorBatch(self.target), self._draft, slots, propose_many, kv)

    @staticmethod
    def _spawn(sched: Runtime, spec: SessionSpec, actors: dict[str, str]) -> None:
        """Each actor with its start (actors/starts.py), sent as the map of its fields."""
        plan, moe = spec.plan, spec.plan is not None and spec.plan.expert_buffer > 0
        threads = 1 if spec.worker is not None else spec.threads  # the verifier and the worker: a core each
        verifier = VerifierStart(
            spec.target_store, spec.sampling, spec.kv_dtype, threads, worker=spec.worker, prompt_cache=spec.prompt_cache
        )
        if spec.worker is not None:
            worker = SparseStart(asdict(spec.model), spec.target_store, spec.worker.columns, spec.kv_dtype)
            sched.spawn("sparse", actors["sparse"], asdict(worker), wait=False)
        if plan is not None and (plan.streamed or moe):
            experts = ExpertRequests(max(1, plan.expert_slots), spec.experts.preload == "router") if moe else None
            verifier = replace(verifier, resident=list(plan.resident), experts=experts)
            loader = LoaderStart(spec.target_store, plan.stream_bytes)
            sched.spawn("loader", actors["loader"], asdict(loader), wait=False)
        sched.spawn("verifier", actors["verifier"], asdict(verifier), wait=False)
        if spec.mode.speculative and (spec.draft_store or spec.flash):
            draft = DraftStart(
                spec.draft_store,
                spec.sampling,
                spec.tree,
                spec.draft_kv_dtype or spec.kv_dtype,
                spec.threads,
                spec.draft_rows or None,
            )
            if spec.flash:  # the target's own sparse FFN (flash/sparse_target.py), from the target's store
                draft = replace(draft, store=spec.target_store, flash=FlashDraft(*spec.flash))
            sched.spawn("draft", actors["draft"], asdict(draft), wait=False)

    @property
    def experts(self):
        """A mixture of experts' buffer under a budget (scheduler/generation/experts.py), or None."""
        return self.target.experts

    @property
    def streamer(self):
        """The loader's side of a streamed target (scheduler/generation/streaming.py), or None."""
        return self.target.streamer

    def close(self):
        self.target.close()
