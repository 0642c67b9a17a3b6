"""Where a run's models live: over the actors (scheduler/generation/session.py `ActorSession`, the
default) or in this process (`LocalSession`, `--runtime inproc`). Either has a speculation cycle
(`loop`, speculative/loop.py) that the runner streams from, the same way.
"""

from __future__ import annotations

import os

from common.errors import CadenceError
from engine.memory import draft_rows, flash_choice, uses_flash_draft, runtime_config
from engine.resolve import Resolved


def local_cycle(r: Resolved, target, draft):
    """The speculation cycle over a target model in this process and a draft side (or None)."""
    from speculative.loop import Speculation
    from speculative.verify import LocalTarget

    cfg = r.cfg
    return Speculation(
        LocalTarget(target), draft, cfg.mode, cfg.tree, cfg.sampling, cfg.context, r.target.args.context_length
    )


class LocalSession:
    """The models in this process: the cycle over `LocalTarget` and `LocalDraft` (or the trie alone)."""

    streamer = experts = None
    sched = None

    def __init__(self, r: Resolved):
        import torch

        from models import loading
        from speculative.drafter import LocalDraft
        from speculative.lookup import TrieDraft

        cfg = r.cfg
        torch.set_num_threads(cfg.threads or os.cpu_count() or 1)
        if cfg.device.startswith("cuda") and not torch.cuda.is_available():
            raise CadenceError("--device cuda was asked for but torch sees no CUDA device; use --device cpu")
        self.target = loading.load_store(r.target, cfg.target, cfg.device)
        self.draft = loading.load_store(r.draft, cfg.draft, cfg.device, draft_rows(cfg, r.draft)) if r.draft else None
        draft = None
        if cfg.speculative and cfg.draft == "flash":  # the target's own sparse FFN (models/flash/sparse_target.py)
            from models.flash.sparse_target import flash_draft

            draft = LocalDraft(flash_draft(self.target.model, r.target, cfg.ffn_density))
        elif cfg.speculative:
            draft = LocalDraft(self.draft.model) if self.draft is not None else TrieDraft(cfg.tree.width)
        self.loop = local_cycle(r, self.target.model, draft)

    def close(self) -> None:
        pass


def open_actors(r: Resolved, plan):
    """The scheduler (its arena, sockets, watchdog) and the run's actors under it: (scheduler, session)."""
    from scheduler.generation.footprint import ACTOR_MODULES
    from scheduler.generation.session import ActorSession, SessionSpec
    from scheduler.runtime import Runtime

    cfg = r.cfg
    # the model actors fork from one zygote that imported torch and the model code once (the modules whose
    # cost scheduler/generation/footprint.py measured)
    preload = (
        *ACTOR_MODULES,
        *(("actors.sparse",) if cfg.worker else ()),
        # imported once, not in the draft's own pages
        *(("models.flash.sparse_target",) if uses_flash_draft(cfg) else ()),
    )
    sched = Runtime(runtime_config(cfg, r.target, plan, preload)).__enter__()
    try:
        spec = SessionSpec(
            cfg.mode,
            str(r.target.dir),
            r.target.args,
            str(r.draft.dir) if r.draft else None,
            cfg.sampling,
            cfg.tree,
            cfg.threads or os.cpu_count() or 1,
            cfg.context,
            plan,
            cfg.worker,
            cfg.experts,
            r.paths,
            draft_rows(cfg, r.target if uses_flash_draft(cfg) else r.draft),
            (cfg.ffn_density, *flash_choice(cfg, r.target, plan)) if uses_flash_draft(cfg) else None,
        )
        return sched, ActorSession(sched, spec)
    except BaseException:
        sched.shutdown()
        raise
