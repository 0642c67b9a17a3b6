"""The model and speculation options the generating commands share (run, chat, serve, plan, bench),
and what they become: a `RunConfig`. Only the CLI reads argparse namespaces; the runtime gets configs."""
from __future__ import annotations

import os

from cadence.errors import CadenceError
from cadence.settings import FORMATS, SamplingConfig, TreeConfig, check_format
from launch.profiles import load_profile, parse_partition
from launch.runner import RUNTIMES, RunConfig
from launch.trace_tools import trace_dir
from models import registry


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
    e = p.add_argument_group("mixture of experts under --memory-budget")
    e.add_argument("--expert-eviction", default="lru", choices=("lru", "edgemoe", "none"),
                   help="which expert leaves the buffer first: least recently used, EdgeMoE's score (activation "
                        "frequency x how soon its layer runs), or none: no buffer, every expert read when used")
    e.add_argument("--expert-preload", default="none", choices=("none", "paths", "router"),
                   help="read the next layer's likely experts while this one computes: paths: EdgeMoE's path "
                        "statistics (launch models profile-experts), router: the next layer's router on this layer's input; "
                        "none (the default): LRU alone was fastest on a 2-core CPU (BENCHMARKS.md)")
    e.add_argument("--expert-preload-k", type=int, default=2, metavar="K", help="experts preloaded per layer")
    p.add_argument("--context", type=int, default=None, metavar="N",
                   help="prompt tokens the memory plan leaves KV cache room for (default: the longest prompt given)")


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
                     draft_vocab=getattr(args, "draft_vocab", None), draft_fmt=getattr(args, "draft_fmt", None),
                     expert_eviction=getattr(args, "expert_eviction", "lru"), expert_preload=getattr(args, "expert_preload", "none"),
                     expert_preload_k=getattr(args, "expert_preload_k", 2))
