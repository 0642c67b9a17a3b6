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
COMMANDS = ("models", "run", "bench", "profile", "trace", "runtime_bench")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="launch", description="cadence: run models larger than memory")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        try:
            mod = importlib.import_module(f"launch.cmd_{name}")
        except ModuleNotFoundError as e:
            if e.name == f"launch.cmd_{name}":
                continue
            raise
        mod.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
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
