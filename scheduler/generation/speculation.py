"""Generation through the actors: the processes a run needs, and the speculation cycle over them.

`ActorSpeculation` starts the verifier (and the loader when layers stream, the sparse worker when
attention is split) and the draft, then runs the one speculation cycle (speculative/loop.py) with
proxies over the wire: scheduler/generation/target.py for the verifier, scheduler/generation/draft.py for the draft, or
the trie alone in this process (`--draft none`). `impl` swaps an actor class for another (the
FAKE actors of the integration tests).
"""
from __future__ import annotations

from dataclasses import asdict
from typing import Callable

from actors.ops import Groups
from cadence.settings import Generation, SamplingConfig, TreeConfig
from scheduler.generation.draft import ActorDraft
from scheduler.runtime import Scheduler
from scheduler.generation.target import ActorTarget
from speculative.lookup import TrieDraft
from speculative.loop import MODES, TARGET_ONLY, Speculation  # noqa: F401  (MODES re-exported)

ACTORS = {"verifier": "actors.verifier:VerifierActor", "draft": "actors.draft:DraftActor",
          "loader": "actors.loader:LoaderActor", "sparse": "actors.sparse:SparseAttnActor"}


class ActorSpeculation:
    def __init__(self, sched: Scheduler, mode: str, target_store: str, draft_store: str | None,
                 sampling: SamplingConfig, cfg: TreeConfig, threads: int, context_length: int, vocab_size: int,
                 plan=None, loader: dict | None = None, worker: dict | None = None, model_args: dict | None = None,
                 draft_vocab: int = 0, kv_context: int | None = None, impl: dict[str, str] | None = None,
                 experts: dict | None = None):
        """`plan` (scheduler/generation/memplan.py): stream the target's groups it does not keep resident.
        `worker` ({"share": s, "columns": c}): split tree attention with the sparse-attention actor, which
        also takes the share s of the dense chunks and, with c > 0, the last share c of every target
        linear layer's output columns in multi-token passes; verifier and worker then run on one core each.
        `draft_vocab` (under a plan): the draft's head keeps only that many token rows (FR-Spec); 0: all.
        `draft_store` None in a speculative mode: no draft model (`--draft none`); the trie of the prompt
        and output n-grams proposes the candidates, here in the scheduler (speculative/lookup.py).
        `kv_context`: the target's KV cache is sized for prompts this long at least, so that the next prompt
        that continues the last one (a conversation) finds its prefix in the cache; None sizes it per prompt.
        `impl`: role -> "module:Class" to start instead of the real actor.
        `experts` (a mixture of experts whose plan has an expert buffer): {"eviction", "preload", "preload_k",
        "profile" (a PathStats or None)}: how the buffer is kept (scheduler/generation/experts.py)."""
        self.s, self.context_length = sched, context_length
        streamer = None
        actors = {**ACTORS, **(impl or {})}
        common = {"sampling": asdict(sampling), "threads": threads}
        vinit = {**common, "store": target_store}
        if worker is not None:
            vinit.update(threads=1, worker=worker)
            sched.spawn("sparse", actors["sparse"], {"threads": 1, "model": model_args, "store": target_store,
                                                     "columns": worker.get("columns", 0.0)}, wait=False)
        moe = plan is not None and plan.expert_buffer > 0
        experts = {"eviction": "lru", "preload": "none", "preload_k": 2, "profile": None, **(experts or {})}
        if plan is not None and (plan.streamed or moe):
            vinit["resident"] = list(plan.resident)
            if moe:  # a request for experts never asks for more than the buffer holds
                vinit["experts"] = {"batch": max(1, plan.expert_slots), "lookahead": experts["preload"] == "router"}
            sched.spawn("loader", actors["loader"], {"store_dir": target_store, "stream_bytes": plan.stream_bytes,
                                                     **(loader or {})}, wait=False)
        sched.spawn("verifier", actors["verifier"], vinit, wait=False)
        speculative = mode not in TARGET_ONLY
        if speculative and draft_store is not None:
            sched.spawn("draft", actors["draft"], {**common, "store": draft_store, "tree": asdict(cfg),
                                                   "embed_on_disk": plan is not None, "head_rows": draft_vocab or None},
                        wait=False)
        sched.wait_ready()
        if "loader" in sched.actors:
            from scheduler.generation.streaming import Streamer

            sizes = sched.call("loader", Groups()).result["groups"]
            if plan.streamed:
                streamer = Streamer(sched, list(plan.streamed), {g: sizes[g] for g in plan.streamed}, prefetch=mode != "std")
        cache = None
        if moe:
            from scheduler.generation.experts import ExpertCache

            cache = ExpertCache(sched, {g: n for g, n in sizes.items() if g.startswith("expert.")}, model_args["n_layers"],
                                model_args["n_experts"], experts["eviction"], experts["preload"], experts["profile"],
                                experts["preload_k"])
        self.target = ActorTarget(sched, cfg, streamer, worker, model_args, cache)
        draft = None
        if speculative:
            draft = ActorDraft(sched, vocab_size) if draft_store is not None else TrieDraft(cfg.width)
        self.loop = Speculation(self.target, draft, mode, cfg, sampling, context_length, kv_context,
                                counter=sched.tracer.counter)

    @property
    def experts(self):
        """A mixture of experts' buffer under a budget (scheduler/generation/experts.py), or None."""
        return self.target.experts

    @property
    def streamer(self):
        """The loader's side of a streamed target (scheduler/generation/streaming.py), or None."""
        return self.target.streamer

    def generate(self, prompt_ids: list[int], max_new: int, stop: set[int],
                 on_tokens: Callable[[list[int]], None] | None = None, mode: str | None = None,
                 cfg: TreeConfig | None = None, on_cycle: Callable | None = None,
                 sampling: SamplingConfig | None = None) -> Generation:
        """The whole generation (speculative/loop.py `Speculation.generate`)."""
        return self.loop.generate(prompt_ids, max_new, stop, on_tokens, on_cycle, mode=mode, cfg=cfg, sampling=sampling)

    def stream(self, prompt_ids: list[int], max_new: int, stop: set[int], mode: str | None = None,
               cfg: TreeConfig | None = None, sampling: SamplingConfig | None = None):
        """Cycle by cycle (speculative/loop.py `Speculation.stream`)."""
        return self.loop.stream(prompt_ids, max_new, stop, mode, cfg, sampling)

    def close(self):
        self.target.close()
