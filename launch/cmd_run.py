"""`launch run`: generate from a prompt or a prompt set, streaming text, optionally writing JSON rows."""
from __future__ import annotations

import os
import sys

import psutil

from cadence.errors import CadenceError
from cadence.paths import check_output
from launch.monitor import add_monitor_args, open_monitor
from launch.monitor_feed import MonitorFeed
from launch.options import add_model_args, run_config, setup_threads
from launch.prompts import Prompt, load_prompts
from launch.results import write_rows
from launch.runner import RunConfig, Runner, print_text
from launch.trace_tools import place_trace
from scheduler.generation.speculation import MODES

DEFAULT_PROMPT = "def quicksort(items):\n"


def add_parser(sub):
    p = sub.add_parser("run", help="generate text")
    p.add_argument("text", nargs="?", default=None, metavar="PROMPT",
                   help="the prompt; - reads it from stdin (as does a piped stdin with no prompt given)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="one prompt (the same as PROMPT)")
    src.add_argument("--prompts", help="a JSONL prompt set: {\"id\", \"kind\", \"prompt\"} per line")
    p.add_argument("--mode", default="tree", choices=MODES)
    add_model_args(p)
    p.add_argument("--json", dest="json_out", help="write one JSON row per prompt to this file")
    add_monitor_args(p)
    p.set_defaults(func=cmd_run)


def one_prompt(args) -> str:
    """The prompt of a run without --prompts: PROMPT, --prompt, stdin (`-`, or piped with neither), or the default."""
    if args.text is not None and args.prompt is not None:
        raise CadenceError("give the prompt once: as PROMPT or as --prompt, not both")
    text = args.text if args.text is not None else args.prompt
    if text == "-" or (text is None and _piped(sys.stdin)):
        text = sys.stdin.read()
        if not text.strip():
            raise CadenceError("the prompt read from stdin is empty; pipe some text in, or give it as PROMPT")
    return DEFAULT_PROMPT if text is None else text


def _piped(f) -> bool:
    """stdin is a pipe or a file (`echo hi | launch run`, `launch run < q.txt`), not a terminal or /dev/null."""
    import stat

    try:
        mode = os.fstat(f.fileno()).st_mode
    except (OSError, ValueError, AttributeError):
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISREG(mode)


def cmd_run(args) -> int:
    if args.json_out:
        check_output(args.json_out, "--json")
    setup_threads(args)
    cfg = run_config(args, args.mode)
    prompts = load_prompts(args.prompts) if args.prompts else [Prompt("prompt", "chat", one_prompt(args))]
    rows: list[dict] = []
    runner = None
    print(f"launch run: loading {cfg.target} ({cfg.mode}, {cfg.fmt}) ...", file=sys.stderr, flush=True)
    try:
        with Runner(cfg, prompts) as runner:
            _generate(args, cfg, runner, prompts, rows)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the actors are stopped and the trace written; keep what finished
        if runner is not None:
            _finish(args, runner, rows)
        raise
    _finish(args, runner, rows)
    return 0


def _generate(args, cfg: RunConfig, runner: Runner, prompts: list[Prompt], rows: list[dict]) -> None:
    if runner.plan is not None:  # `launch plan` prints it in full
        print(runner.plan.summary(), file=sys.stderr, flush=True)
    experts = runner.spec.experts if runner.sched is not None and runner.spec.experts is not None else None
    feed = MonitorFeed(runner.sched, title=f"{cfg.mode} {cfg.target} {cfg.fmt}",
                       experts=experts.totals if experts is not None else None) if runner.sched is not None else \
        MonitorFeed(None, budget_bytes=psutil.virtual_memory().total, title=f"{cfg.mode} {cfg.target} {cfg.fmt}")
    mon = open_monitor(feed, args.monitor)
    on_text = feed.on_text if mon.shows_text else (lambda piece: (feed.on_text(piece), print_text(piece)))
    mon.start()
    try:
        for p in prompts:
            if len(prompts) > 1 and not mon.shows_text:
                print(f"\n── {p.id} ({p.kind})", flush=True)
            row = runner.run(p, on_text=on_text, on_cycle=feed.on_tokens)
            rows.append(row)
            st = row["stats"]
            extra = f", {st['mean_accepted']} accepted per verification" if "mean_accepted" in st else ""
            print(f"\n[{len(row['new_token_ids'])} tokens in {row['wall_s']:.2f} s, {row['tokens_per_s']:.2f} tok/s, "
                  f"mode {row['mode']}, {cfg.fmt}{extra}]", file=sys.stderr, flush=True)
    finally:
        mon.stop()
        feed.close()


def _finish(args, runner: Runner, rows: list[dict]) -> None:
    """The trace's place and the rows: after the run, or after an interruption with what it finished."""
    path = place_trace(runner.trace_path, getattr(args, "trace_path", None))
    if path:
        print(f"trace: {path}", file=sys.stderr)
    if args.json_out:
        write_rows(args.json_out, rows)
        print(f"wrote {len(rows)} rows to {args.json_out}", file=sys.stderr)
