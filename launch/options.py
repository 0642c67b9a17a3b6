"""The run options as flags: every generating command (run, chat, serve, plan, bench) gets the same
ones, made from the option table (engine/options.py), and turns them into a `RunConfig` the same way
(`run_config`). Only the CLI reads argparse namespaces; the engine gets configs.
"""

from __future__ import annotations

import argparse

from engine.config import RunConfig
from engine.options import OPTIONS, Option


HELP_ALL = "--help-all"  # `--help` lists the common options; this, every one
_shown = {"all": False}


def show_all(on: bool) -> None:
    """Whether the parsers built next list every option in their help (the command line asked --help-all)."""
    _shown["all"] = on


def add_run_options(p: argparse.ArgumentParser, **defaults) -> None:
    """Every run option as a flag; `defaults` changes a command's own (bench: max_new_tokens=128). `--help`
    shows the common ones (--help-all every one)."""
    full = _shown["all"]
    groups: dict[str | None, object] = {None: p}
    hidden = 0
    for o in OPTIONS:
        if o.group not in groups and full:
            groups[o.group] = p.add_argument_group(o.group)
        hidden += not (full or o.common)
        _add(groups[o.group if full else None], o, defaults.get(o.name, o.default), full or o.common)
    p.add_argument(HELP_ALL, action="help", help="show every option, not only the common ones")
    if hidden:
        p.epilog = (
            f"{hidden} more options (speculation, memory, mixtures of experts, the sparse worker, traces): {HELP_ALL}"
        )


def _add(p, o: Option, default, shown: bool) -> None:
    text = o.help if shown else argparse.SUPPRESS
    if o.kind is bool:
        p.add_argument(o.flag, *o.aliases, dest=o.name, action="store_true", help=text)
        return
    p.add_argument(
        o.flag,
        *o.aliases,
        dest=o.name,
        type=o.kind,
        default=default,
        help=text,
        choices=o.choices or None,
        metavar=o.metavar,
    )


def options_of(args: argparse.Namespace) -> dict:
    """The run options a command line gave."""
    return {o.name: getattr(args, o.name) for o in OPTIONS}


def run_config(args: argparse.Namespace, **override) -> RunConfig:
    """The configuration of the run a command line asks for (`override`: options a command fixes)."""
    return RunConfig.from_options(**{**options_of(args), **override})


def add_model_action(msub, name: str, help: str, model: str, func):
    """A `launch models` action on one model: its parser, with the model as the positional `name` (`model` says
    what it may be) and `func` set; the caller adds the action's own options."""
    p = msub.add_parser(name, help=help)
    p.add_argument("name", help=model)
    p.set_defaults(func=func)
    return p


def add_calibration(p, store_help: str, tokens_note: str) -> None:
    """The options of a command that runs a model on calibration prompts: its store, the prompts, the tokens."""
    p.add_argument("--dtype", "--format", dest="fmt", default="int4", help=store_help)
    p.add_argument("--prompts", default=None, help="calibration prompts (JSONL; default: the development set)")
    p.add_argument("--tokens", type=int, default=64, help=f"tokens the model generates per prompt ({tokens_note})")
