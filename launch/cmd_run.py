"""`launch run`: generate from a prompt or a prompt set, streaming text, optionally writing JSON rows."""
from __future__ import annotations

import os
import sys

import psutil

from cadence.errors import CadenceError
from cadence.paths import check_output
from launch.monitor import add_monitor_args, open_monitor
from launch.monitor_feed import MonitorFeed
from launch.prompts import Prompt, load_prompts
from launch.trace_tools import place_trace, trace_dir
from launch.results import write_rows
from launch.runner import RUNTIMES, RunConfig, Runner, print_text
from cadence.settings import FORMATS, SamplingConfig, TreeConfig, check_format
from models import registry
from scheduler.speculation import MODES

DEFAULT_PROMPT = "def quicksort(items):\n"


def add_model_args(p):
    p.add_argument("--target", default=registry.DEFAULT_TARGET, help="target model: a default name, a .gguf file or an HF directory")
    p.add_argument("--draft", default="auto",
                   help=f"draft model for the speculative modes; auto: {registry.DEFAULT_DRAFT}, or another known model "
                        "that shares the target's tokenizer, or none; none: tree mode with no draft model, the n-gram "
                        "trie of the prompt and output proposes (for budgets that cannot hold a draft)")
    p.add_argument("--dtype", "--format", dest="fmt", default="int4", help=f"weight format: {', '.join(FORMATS)}")
    p.add_argument("--draft-dtype", dest="draft_fmt", default=None,
                   help="the draft's weight format (default: --dtype), e.g. an int4 draft for a bf16 target")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chat", default="auto", choices=("auto", "on", "off"),
                   help="apply the model's chat template (auto: for prompt kinds copy/open)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads per process (default 0: all cores)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (cuda needs --runtime inproc)")
    p.add_argument("--runtime", default="actors", choices=RUNTIMES,
                   help="actors: draft and verifier as processes under the scheduler; inproc: one process")
    t = p.add_argument_group("speculation")
    t.add_argument("--width", type=int, default=TreeConfig.width, help="tree mode: most draft tokens per verification")
    t.add_argument("--chain-k", type=int, default=TreeConfig.chain_k, help="chain mode: draft tokens per verification")
    t.add_argument("--branch-threshold", type=float, default=TreeConfig.branch_threshold,
                   help="tree mode: a candidate with at least this draft probability opens a branch")
    t.add_argument("--alpha", type=float, default=TreeConfig.alpha, help="initial fallback threshold (verify when Tc < alpha)")
    t.add_argument("--no-trie", action="store_true", help="tree mode: no Lookahead trie candidates")
    t.add_argument("--fixed-width", action="store_true", help="always use the full width (no adaptive governor)")
    t.add_argument("--draft-ahead", default="auto",
                   help="greedy chain/tree over actors: draft forwards (on one thread) the draft may run while the "
                        "target verifies, LLMCad's speculative drafting during verification; auto: up to 4, and only "
                        "while the streamed target keeps the verifier waiting on the disk (on a 2-core CPU drafting "
                        "beside a busy verifier slows it more than it saves, BENCHMARKS.md); 0: never")
    t.add_argument("--draft-window", type=int, default=TreeConfig.prompt_window,
                   help="the draft runs on the prompt's last N tokens only (0: the whole prompt); its prefill "
                        "costs about a draft step per token on a CPU")
    p.add_argument("--trace-dir", default=None,
                   help="the folder for the Chrome trace (default: ./traces if it exists, else $CADENCE_HOME/traces)")
    p.add_argument("--no-trace", action="store_true", help="write no trace")
    p.add_argument("--profile", default=None, help="an ARCA profile (launch profile --out): its width, tree and partition")
    p.add_argument("--sparse-worker", action="store_true",
                   help="split tree attention with the CPU sparse-attention actor (Ghidorah); one core each")
    p.add_argument("--worker-share", type=float, default=0.0,
                   help="with --sparse-worker: the share of the dense attention chunks the worker takes too")
    p.add_argument("--column-share", type=float, default=0.0,
                   help="with --sparse-worker: the share of every target linear layer's output columns the worker "
                        "computes in multi-token passes (Ghidorah's column split; the target must be resident)")
    p.add_argument("--memory-budget", default=None,
                   help="hard memory bound for the whole run, e.g. 3GiB or auto (draft + KV + half the target); "
                        "target layers that do not fit stream from disk")
    p.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                   help="the draft proposes only the N most frequent tokens (FR-Spec: its output head keeps N rows); "
                        "default 32768 under --memory-budget, else the whole vocabulary; 0: the whole vocabulary")
    p.add_argument("--context", type=int, default=None, metavar="N",
                   help="prompt tokens the memory plan leaves KV cache room for (default: the longest prompt given)")


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


def setup_threads(args):
    """Only a run whose models live in this process imports torch here: with the actor runtime the
    launch process is the scheduler, torch-free, and each model actor sets its own threads."""
    if args.threads < 0:
        raise CadenceError(f"--threads {args.threads} is not a thread count; give a number of threads, or 0 for all cores")
    if args.runtime != "inproc" and args.device == "cpu":
        return
    import torch

    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise CadenceError("--device cuda was asked for but torch sees no CUDA device; use --device cpu")


AUTO_AHEAD = 4


def _ahead(args) -> int:
    if args.draft_ahead == "auto":
        return AUTO_AHEAD
    try:
        return int(args.draft_ahead)
    except ValueError:
        raise CadenceError(f"--draft-ahead {args.draft_ahead} is neither auto nor a number of draft steps") from None


def tree_config(args, mode: str, profile: dict | None = None) -> TreeConfig:
    tree = TreeConfig(mode="chain" if mode == "chain" else "tree", width=args.width, chain_k=args.chain_k,
                      branch_threshold=args.branch_threshold, alpha=args.alpha, trie=not args.no_trie,
                      adaptive=not args.fixed_width, ahead=_ahead(args) if args.runtime == "actors" else 0,
                      ahead_auto=args.draft_ahead == "auto",
                      prompt_window=args.draft_window)
    if profile and profile["width"] > 0 and mode == "tree":  # ARCA's width and static tree
        tree = TreeConfig(**{**tree.__dict__, "width": profile["width"], "trie": False, "adaptive": False,
                             "shape_parents": tuple(profile["tree"]["parents"]), "shape_ranks": tuple(profile["tree"]["ranks"])})
    return tree


def run_config(args, mode: str) -> RunConfig:
    check_format(args.fmt)
    profile = None
    worker, share, columns = args.sparse_worker, args.worker_share, args.column_share
    if getattr(args, "profile", None):
        from launch.cmd_profile import load_profile, parse_partition

        profile = load_profile(args.profile)
        if profile["partition"] != "none":
            worker, (share, columns) = True, parse_partition(profile["partition"])
    return RunConfig(target=args.target, draft=args.draft, fmt=args.fmt, mode=mode, max_new_tokens=args.max_new_tokens,
                     sampling=SamplingConfig(args.temperature, args.top_p, args.seed), tree=tree_config(args, mode, profile),
                     chat=args.chat, device=args.device, runtime=args.runtime, threads=args.threads,
                     trace_dir=args.trace_dir or trace_dir(getattr(args, "trace_path", None)),
                     trace=not getattr(args, "no_trace", False),
                     memory_budget=args.memory_budget, sparse_worker=worker,
                     worker_share=share, column_share=columns, plan_context=getattr(args, "context", None),
                     draft_vocab=getattr(args, "draft_vocab", None), draft_fmt=getattr(args, "draft_fmt", None))


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
    feed = MonitorFeed(runner.sched, title=f"{cfg.mode} {cfg.target} {cfg.fmt}") if runner.sched is not None else \
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
