"""`launch`: the command line. argparse lives here and nowhere else.

Each subcommand is a module with `add_parser(subparsers)` that sets `func` on its parser;
`func(args)` returns an exit code. A `CadenceError` anywhere ends in one readable sentence.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from cadence.errors import CadenceError

# subcommand module names, in the order `launch --help` lists them
COMMANDS = ("models", "run", "plan", "bench", "profile", "trace", "runtime_bench")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """With `only` (the command typed), just that command's module is imported: `launch run` must not
    import what `launch bench` needs (torch, HF), since the launch process is the run's scheduler and
    its memory counts against the budget."""
    parser = argparse.ArgumentParser(prog="launch", description="cadence: run models larger than memory")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        if only is not None and name != only:
            continue
        try:
            mod = importlib.import_module(f"launch.cmd_{name}")
        except ModuleNotFoundError as e:
            if e.name == f"launch.cmd_{name}":
                continue
            raise
        mod.add_parser(sub)
    return parser


def _command(argv: list[str]) -> str | None:
    """The subcommand module named by argv, if argv names one before any option."""
    first = next((a for a in argv if not a.startswith("-")), None)
    if first is None or argv.index(first) != 0:
        return None
    name = first.replace("-", "_")
    return name if name in COMMANDS else None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(_command(argv))
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("launch: interrupted", file=sys.stderr)
        return 130
    except CadenceError as e:
        print(f"launch: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
