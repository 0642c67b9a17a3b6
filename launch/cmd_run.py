"""`launch run`: generate from a prompt or a prompt set, streaming text, optionally writing JSON rows.

Rows are written as they finish (the JSON file rewritten atomically after each), so an interrupted or
killed run keeps what it finished; in a prompt set, a prompt that cannot run (too long, not text) is
reported and skipped, the others run, and the exit code says so (EXIT_SKIPPED).
"""

from __future__ import annotations

import os
import stat
import sys

from common.errors import CadenceError, PromptError
from common.paths import check_output
from engine.config import DEFAULT_NEW_TOKENS
from engine.prompts import Prompt, load_prompts
from engine.rows import write_rows
from engine.runner import Runner
from launch.options import add_run_options, run_config
from observe.feed import MonitorFeed
from observe.monitor import add_monitor_args, open_monitor
from observe.traces import place_trace, trace_dir

DEFAULT_PROMPT = "def quicksort(items):\n"
EXIT_SKIPPED = 3  # some prompts were reported and skipped; the others ran


def add_parser(sub):
    p = sub.add_parser("run", help="generate text")
    p.add_argument(
        "text",
        nargs="?",
        default=None,
        metavar="PROMPT",
        help="the prompt; - reads it from stdin (as does a piped stdin with no prompt given)",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="one prompt (the same as PROMPT)")
    src.add_argument(
        "--prompts",
        help='JSONL, {"id", "kind", "prompt"} a line; kind: complete (raw text, the default), copy, open, chat',
    )
    p.add_argument("--json", dest="json_out", help="write one JSON row per prompt to this file, as each finishes")
    add_run_options(p)
    add_monitor_args(p)
    p.set_defaults(func=cmd_run)


def one_prompt(args) -> str:
    """The prompt of a run without --prompts: PROMPT, --prompt, stdin (`-`, or piped with neither), or the default."""
    if args.text is not None and args.prompt is not None:
        raise CadenceError("give the prompt once: as PROMPT or as --prompt, not both")
    text = args.text if args.text is not None else args.prompt
    if text == "-" or (text is None and _piped(sys.stdin)):
        text = _stdin_text()
        if not text.strip():
            raise CadenceError("the prompt read from stdin is empty; pipe some text in, or give it as PROMPT")
    return DEFAULT_PROMPT if text is None else text


def _stdin_text() -> str:
    raw = sys.stdin.buffer.read()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CadenceError(
            f"the prompt read from stdin is not UTF-8 text (byte {raw[e.start]:#04x} at offset {e.start}); "
            "convert it first, e.g. with iconv -t UTF-8"
        ) from None


def _piped(f) -> bool:
    """stdin is a pipe or a file (`echo hi | launch run`, `launch run < q.txt`), not a terminal or /dev/null."""
    try:
        mode = os.fstat(f.fileno()).st_mode
    except (OSError, ValueError, AttributeError):
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISREG(mode)


def cmd_run(args) -> int:
    if args.json_out:
        check_output(args.json_out, "--json")
    wanted = getattr(args, "trace_path", None)
    cfg = run_config(args, **({"trace_dir": trace_dir(wanted)} if wanted and not args.trace_dir else {}))
    prompts = load_prompts(args.prompts) if args.prompts else [Prompt("prompt", "chat", one_prompt(args))]
    print(f"launch run: loading {cfg.target} ({cfg.mode}, {cfg.dtype}) ...", file=sys.stderr, flush=True)
    rows: list[dict] = []
    runner = None
    try:
        with Runner(cfg, prompts) as runner:
            runner.bound_new_tokens(DEFAULT_NEW_TOKENS)
            skipped = _generate(args, runner, prompts, rows)
    finally:  # also on Ctrl-C or SIGTERM: the actors are stopped; the trace's place and the rows so far
        if runner is not None:
            _finish(args, runner, rows)
    return EXIT_SKIPPED if skipped else 0


def _generate(args, runner: Runner, prompts: list[Prompt], rows: list[dict]) -> int:
    """Every prompt, with the monitor; the number skipped."""
    run = runner.plan
    print(_run_line(runner), file=sys.stderr, flush=True)
    title = f"{run.mode} {run.target_name} {run.format}"
    if runner.sched is not None:
        experts = runner.session.experts
        feed = MonitorFeed(runner.sched, title=title, experts=experts.totals if experts is not None else None)
    else:
        feed = MonitorFeed(None, title=title)
    mon = open_monitor(feed, args.monitor)
    mon.start()
    try:
        return _each(args, runner, prompts, rows, feed, mon)
    finally:
        mon.stop()
        feed.close()


def _each(args, runner: Runner, prompts: list[Prompt], rows: list[dict], feed, mon) -> int:
    """Every prompt through the run's batch (`--parallel N`: N at a time together); the number skipped. One at a
    time, each one's text is written as it comes; several at a time, each one's whole text as it finishes, in the
    order they finish (each row has its prompt's id)."""
    skipped, live = 0, runner.plan.parallel <= 1
    started = None  # one at a time: the prompt whose text is being written
    for p, c in runner.stream_many(prompts):
        if isinstance(c, PromptError):
            if len(prompts) == 1:
                raise c
            skipped += 1
            print(f"\nlaunch run: prompt {p.id} skipped: {c}", file=sys.stderr, flush=True)
            continue
        if isinstance(c, CadenceError):
            raise c
        if live:
            if started is not p and len(prompts) > 1 and not mon.shows_text:
                print(f"\n── {p.id} ({p.kind})", flush=True)
            started = p
            _show(c, feed, mon)
        else:
            feed.on_tokens(len(c.tokens), c.accepted, c.alpha)  # the texts of several generations do not make one
        if c.completion is None:
            continue
        rows.append(c.completion.row)
        if args.json_out:
            write_rows(args.json_out, rows)  # atomically, each time: a killed run keeps what finished
        if not mon.shows_text:  # one at a time the text ends its line; several: it is written whole now
            print("" if live else f"\n── {p.id} ({p.kind})\n{c.completion.text}", flush=True)
        print(_row_line(c.completion.row, runner), file=sys.stderr, flush=True)
        bounded(args.max_new_tokens, c.completion, "launch run")
    return skipped


def bounded(given: int | None, done, door: str) -> None:
    """One line where a generation stopped at the default bound (`Runner.bound_new_tokens`), not at its end
    (`given`: the --max-new-tokens given, if any)."""
    if not given and done.finish_reason == "length" and len(done.token_ids) >= DEFAULT_NEW_TOKENS:
        print(
            f"{door}: stopped at {DEFAULT_NEW_TOKENS} new tokens, the default bound (--max-new-tokens N sets another)",
            file=sys.stderr,
            flush=True,
        )


def _show(chunk, feed: MonitorFeed, mon) -> None:
    feed.on_chunk(chunk)
    if chunk.text and not mon.shows_text:
        sys.stdout.write(chunk.text)
        sys.stdout.flush()


def _run_line(runner: Runner) -> str:
    """What the run is, in a line (and its plan under a budget: `launch plan` prints it in full)."""
    return "\n".join([runner.plan.summary(), *runner.session.lines()])


def _row_line(row: dict, runner: Runner) -> str:
    st = row["stats"]
    accepted = f", {st['mean_accepted']} accepted per verification" if "mean_accepted" in st else ""
    if row.get("approximate"):
        fl = row["flash"]
        accepted += (
            f", APPROXIMATE (FFN density {row['ffn_density']}, {fl['decode_read_bytes_per_token'] / 2**20:.1f} MiB "
            f"read a token, cache hit rate {fl['hit_rate']:.2f})"
        )
    held = runner.held_bytes()
    return (
        f"[{len(row['new_token_ids'])} tokens in {row['wall_s']:.2f} s, {row['tokens_per_s']:.2f} tok/s, "
        f"mode {row['mode']}, {row['format']}{accepted}, {held / 2**20:.0f} MiB held, "
        f"ended by {row['finish_reason']}]"
    )


def _finish(args, runner: Runner, rows: list[dict]) -> None:
    path = place_trace(runner.trace_path, getattr(args, "trace_path", None))
    if path:
        print(f"trace: {path}", file=sys.stderr)
    if args.json_out:
        write_rows(args.json_out, rows)
        print(f"wrote {len(rows)} rows to {args.json_out}", file=sys.stderr)
