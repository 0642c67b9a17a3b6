"""The run options as flags: every generating command (run, chat, serve, plan, bench) gets the same
ones, made from the option table (engine/options.py), and turns them into a `RunConfig` the same way
(`run_config`). Only the CLI reads argparse namespaces; the engine gets configs.
"""
from __future__ import annotations

import argparse

from engine.config import RunConfig
from engine.options import DEFAULTS, OPTIONS, Option


def add_run_options(p: argparse.ArgumentParser, **defaults) -> None:
    """Every run option as a flag; `defaults` changes a command's own (bench: max_new_tokens=128)."""
    groups: dict[str | None, object] = {None: p}
    for o in OPTIONS:
        if o.group not in groups:
            groups[o.group] = p.add_argument_group(o.group)
        _add(groups[o.group], o, defaults.get(o.name, o.default))


def _add(p, o: Option, default) -> None:
    if o.kind is bool:
        p.add_argument(o.flag, *o.aliases, dest=o.name, action="store_true", help=o.help)
        return
    p.add_argument(o.flag, *o.aliases, dest=o.name, type=o.kind, default=default, help=o.help,
                   choices=o.choices or None, metavar=o.metavar)


def options_of(args: argparse.Namespace) -> dict:
    """The run options a command line gave."""
    return {o.name: getattr(args, o.name) for o in OPTIONS}


def run_config(args: argparse.Namespace, **override) -> RunConfig:
    """The configuration of the run a command line asks for (`override`: options a command fixes)."""
    return RunConfig.from_options(**{**options_of(args), **override})


def describe(cfg: RunConfig) -> str:
    """The run in one line: its models, context and runtime, and every option it was given that is not
    the default (what a user checks to see that an option reached the run)."""
    given = {k: v for k, v in cfg.options().items() if v != DEFAULTS[k] and k not in ("target", "mode", "dtype", "draft")}
    draft = f", draft {cfg.draft_model}" if cfg.draft_model else ", no draft model" if cfg.speculative else ""
    extra = "; " + " ".join(f"{k}={v}" for k, v in given.items()) if given else ""
    return f"{cfg.mode} {cfg.target} {cfg.dtype}{draft}; context {cfg.context} tokens; {cfg.runtime}{extra}"
