"""A mixture of experts' run options: how the expert buffer is kept under a budget, and the path profile
(EdgeMoE's statistics, `launch models profile-experts`) read from beside the weight store."""
from __future__ import annotations

from cadence.errors import CadenceError

PATHS_FILE = "expert_paths.json"  # EdgeMoE's path statistics, profiled on calibration prompts (launch models profile-experts)


def expert_options(cfg, target_store) -> dict | None:
    """How a mixture of experts keeps its expert buffer; the path profile read from beside its store."""
    if not target_store.args.moe:
        return None
    profile = None
    if cfg.expert_preload == "paths" or cfg.expert_eviction == "edgemoe":
        from scheduler.generation.expert_policy import PathStats

        path = target_store.dir / PATHS_FILE
        if path.exists() or cfg.expert_preload == "paths":
            if not path.exists():
                raise CadenceError(f"--expert-preload paths needs the expert path profile of {target_store.dir.name}; "
                                   f"write it with `launch models profile-experts {cfg.target}`")
            profile = PathStats.load(path)
    return {"eviction": cfg.expert_eviction, "preload": cfg.expert_preload, "preload_k": cfg.expert_preload_k,
            "profile": profile}
