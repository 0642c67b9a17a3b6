"""`launch calibrate`: measure this machine's costs again for a pair of models (engine/costs.py), whatever is
cached, and say what was measured and whether it was kept: after a hardware change, or where a first measurement
was taken at a bad moment. The plans that follow price their choices with it."""

from __future__ import annotations

from common.errors import CadenceError
from engine.machine import ThisMachine
from launch.options import add_run_options, run_config


def add_parser(sub):
    p = sub.add_parser("calibrate", help="measure this machine's forward and disk costs again (what plans price)")
    add_run_options(p)
    p.set_defaults(func=cmd_calibrate)


def cmd_calibrate(args) -> int:
    from engine.costs import costs

    cfg = run_config(args)
    machine = ThisMachine(say=print)
    target = machine.store(cfg.target, cfg.dtype)
    name = cfg.draft_model or (machine.pick_draft(cfg.target)[0] if cfg.draft == "auto" else None)
    draft = machine.store(name, cfg.draft_dtype or cfg.dtype) if name else None
    if cfg.draft not in ("auto", "none") and draft is None:
        raise CadenceError(f"--draft {cfg.draft} is not a model to measure; give a model, auto or none")
    got = costs(target, draft, print, fresh=True)
    print(got.describe())
    return 0 if got.kept else 1
