"""`launch`: the command line. argparse lives here and nowhere else.

Each subcommand is a module with `add_parser(subparsers)` that sets `func` on its parser;
`func(args)` returns an exit code. A `CadenceError` anywhere ends in one readable sentence.
The product's commands are launch/cmd_*.py; other packages add theirs as plugins (entry points of the
group `launch.commands`): `bench`, `profile` and `runtime-bench` come from bench/, which the product
never imports.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import importlib.metadata
import os
import re
import signal
import sys

from common.errors import CadenceError, Terminated, UsageError, stop_on_sigterm

# subcommand module names, in the order `launch --help` lists them (the plugins' follow)
COMMANDS = ("models", "run", "chat", "serve", "plan", "calibrate", "trace")
PLUGINS = "launch.commands"  # the entry-point group of commands from outside the product: name -> module


def plugins() -> dict[str, str]:
    """The commands other installed packages add, by name (`bench` -> `bench.cmd_bench`)."""
    return {e.name: e.value for e in importlib.metadata.entry_points(group=PLUGINS)}


class _Help(argparse.HelpFormatter):
    """Every option's default in its help line. argparse.ArgumentDefaultsHelpFormatter skips options
    without help text and prints "(default: None)" for options that have no default."""

    def _format_action(self, action):
        text = action.help or ""
        if action.option_strings and _has_default(action) and not re.search(r"\(default|; default|default:", text):
            action = copy.copy(action)  # the parser's own action keeps its help
            action.help = f"{text} (default: %(default)s)".lstrip()
        return super()._format_action(action)


def _has_default(action) -> bool:
    """A value the option takes when not given: flags (nargs 0) have none, and 0 counts where None does not."""
    d = action.default
    return action.nargs != 0 and not (d is None or d == argparse.SUPPRESS)


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _Help)
        super().__init__(*args, **kwargs)


def version() -> str:
    try:
        return importlib.metadata.version("cadence")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed; run ./setup.sh)"


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """With `only` (the command typed), just that command's module is imported: `launch run` must not
    import what `launch bench` needs (torch, HF), since the launch process is the run's scheduler and
    its memory counts against the budget."""
    parser = _Parser(prog="launch", description="cadence: run models larger than memory")
    parser.add_argument("--version", action="version", version=f"cadence {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    modules = {name: f"launch.cmd_{name}" for name in COMMANDS} | plugins()
    for name, module in modules.items():
        if only is not None and name != only:
            continue
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name == module:
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
    return name if name in COMMANDS or name in plugins() else None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv == ["--version"]:  # answered without importing every command's module (torch among them)
        print(f"cadence {version()}")
        return 0
    from launch.options import HELP_ALL, show_all

    show_all(HELP_ALL in argv)
    try:
        parser = build_parser(_command(argv))  # imports the command's module: a Ctrl-C may land here
    except KeyboardInterrupt:
        print("launch: interrupted", file=sys.stderr)
        return 130
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    stop_on_sigterm()
    try:
        return int(args.func(args) or 0)
    except Terminated:
        print("launch: stopped by SIGTERM", file=sys.stderr)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        print("launch: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader left (`launch run | head`): end quietly, as `cat` does; stdout goes to /dev/null so the
        # interpreter's last flush at exit does not fail on the closed pipe too
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except CadenceError as e:
        print(f"launch: {e}", file=sys.stderr)
        return 2 if isinstance(e, UsageError) else 1


if __name__ == "__main__":
    sys.exit(main())
