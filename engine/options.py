"""Every option of a run, once: its name, default and help.

The command line (`launch run`, `chat`, `serve`, `plan`, `bench`: launch/options.py builds their
flags from this table) and the Python API (`cadence.LLM(**options)`) take the same options under the
same names; `RunConfig.from_options` (engine/config.py) turns them into one typed configuration and
`RunConfig.options` gives them back. A name is the flag without its dashes, `-` as `_`:
`--max-new-tokens 64` is `max_new_tokens=64`.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.modes import MODES
from common.settings import FORMATS, GROWTHS, PROMPT_WINDOW, WIDER, TreeConfig
from pulls.registry import DEFAULT_DRAFT, DEFAULT_TARGET
from models.shapes import KV_DTYPES

RUNTIMES = ("actors", "inproc")
AUTO_AHEAD = 4  # --draft-ahead auto: at most this many draft steps per verification


@dataclass(frozen=True)
class Option:
    name: str
    default: object
    help: str
    kind: type = str  # bool: a flag that is off unless given
    choices: tuple = ()
    group: str | None = None  # the heading `--help` lists it under
    aliases: tuple = ()  # other spellings of the flag
    metavar: str | None = None
    common: bool = False  # `--help` lists it; the others only `--help-all`

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


SAMPLING = "sampling (with --temperature > 0; the penalties under greedy too)"
SPECULATION = "speculation"
MEMORY = "memory"
EXPERTS = "mixture of experts under --memory-budget"
WORKER = "the sparse-attention worker (Ghidorah)"
OUTPUT = "output"

OPTIONS: tuple[Option, ...] = (
    # the common ones first: what `--help` shows at the top
    Option(
        "target",
        DEFAULT_TARGET,
        "target model: a default name, a .gguf file, an HF directory or a weight store",
        common=True,
    ),
    Option(
        "mode",
        "tree",
        "tree: token-tree speculation; chain: classic speculative decoding; target: the target "
        "alone; std, stdpl: the target alone streamed under --memory-budget (without / with prefetch); flash: "
        "APPROXIMATE, only the FFN neurons a predictor picks (LLM in a flash)",
        choices=MODES,
        common=True,
    ),
    Option(
        "memory_budget",
        None,
        "hard memory bound for the whole run, e.g. 1GiB, 768MiB or auto (the smallest "
        "budget that works and half the target); target layers that do not fit stream from disk",
        common=True,
    ),
    Option(
        "max_new_tokens",
        None,
        "most tokens to generate (default: run and chat stop at 1024, said; serve: at the turn's or context's end)",
        kind=int,
        metavar="N",
        common=True,
    ),
    Option("temperature", 0.0, "0 means greedy: the output is exactly the target model's", kind=float, common=True),
    Option(
        "top_p",
        1.0,
        "nucleus sampling: the smallest set of tokens whose probability reaches P",
        kind=float,
        common=True,
    ),
    Option("seed", 0, "the sampling seed (one seed, one text)", kind=int, common=True),
    Option("top_k", 0, "sample among the K likeliest tokens only (0: all)", kind=int, group=SAMPLING, metavar="K"),
    Option(
        "min_p", 0.0, "drop tokens below P times the likeliest's probability", kind=float, group=SAMPLING, metavar="P"
    ),
    Option(
        "repetition_penalty",
        1.0,
        "divide the logit of each token in the recent text by this (llama.cpp's --repeat-penalty; 1: none)",
        kind=float,
        group=SAMPLING,
        aliases=("--repeat-penalty",),
        metavar="X",
    ),
    Option(
        "presence_penalty",
        0.0,
        "lower the logit of each token in the recent text by this",
        kind=float,
        group=SAMPLING,
        metavar="X",
    ),
    Option(
        "frequency_penalty",
        0.0,
        "lower the logit of each token in the recent text by this times its count",
        kind=float,
        group=SAMPLING,
        metavar="X",
    ),
    Option(
        "repeat_last_n",
        64,
        "the recent text the penalties read: its last N tokens, prompt included (-1: all)",
        kind=int,
        group=SAMPLING,
        metavar="N",
    ),
    Option(
        "logprobs",
        -1,
        "keep each generated token's log-probability and the N likeliest tokens' (the JSON rows' stats; -1: none)",
        kind=int,
        group=OUTPUT,
        metavar="N",
    ),
    Option(
        "prompt_logprobs",
        False,
        "with --logprobs: each prompt token's log-probability too (the whole prompt prefilled, no cached prefix)",
        kind=bool,
        group=OUTPUT,
    ),
    Option(
        "grammar",
        "",
        "hold the output to a grammar: a JSON schema (a .json file or its text), a Lark (.lark) or GBNF (.gbnf) one",
        group=SAMPLING,
        metavar="G",
    ),
    Option(
        "draft",
        "auto",
        f"draft model for the speculative modes; auto: {DEFAULT_DRAFT} or another known model sharing the "
        "target's tokenizer, or none; none: no draft model, the n-gram trie proposes; flash: the target's own "
        "sparse FFN",
        common=True,
    ),
    Option(
        "dtype",
        "int4",
        f"weight format: {', '.join(FORMATS)} (converted once, on first use; int2: the FFN in 2 bits, the rest int4)",
        choices=FORMATS,
        aliases=("--format",),
        common=True,
    ),
    Option(
        "draft_dtype",
        None,
        "the draft's weight format (default: --dtype; under a budget too small for it, int2 where that fits), "
        "e.g. an int4 draft for a bf16 target",
        choices=FORMATS,
    ),
    Option(
        "chat",
        "auto",
        "the chat template (auto: command-line prompts, kinds copy/open/chat, models with their own)",
        choices=("auto", "on", "off"),
        common=True,
    ),
    Option(
        "context",
        None,
        "tokens a generation may hold, prompt and answer (the KV caches' room; default: the "
        "longest prompt plus --max-new-tokens where both are known, else 4096, or 2048 under --memory-budget; "
        "at most the model's context)",
        kind=int,
        metavar="N",
        common=True,
    ),
    Option("threads", 0, "CPU threads per process (0: all cores)", kind=int, common=True),
    Option(
        "parallel",
        1,
        "generations at once, each in a slot with KV caches of its own, every cycle's trees verified in one "
        "forward (under --memory-budget a streamed layer is read once for all of them); --context is each slot's; "
        "0: as many as the memory allows, up to 4 (launch serve's default)",
        kind=int,
        metavar="N",
        group=MEMORY,
    ),
    Option("device", "cpu", "cpu or cuda (cuda needs --runtime inproc)"),
    Option(
        "runtime",
        "actors",
        "actors: draft and verifier as processes under the scheduler; inproc: one process",
        choices=RUNTIMES,
    ),
    Option(
        "width",
        0,
        f"tree mode: most draft tokens per verification (0: {TreeConfig.width}, or up to {WIDER[0]} under a memory "
        "budget where this machine verifies that many while the disk reads the streamed layers)",
        kind=int,
        group=SPECULATION,
    ),
    Option(
        "prompt_cache",
        "auto",
        "keep prompts' KV rows past their slot for later prompts that continue them (conversations taking turns, "
        "a shared system prompt): auto: where the run serves requests (serve, chat, cadence.LLM), in memory "
        "without a budget, on disk ($CADENCE_HOME/prompt-cache) under --memory-budget; a folder: on disk there as "
        "well, found again by later runs; off",
        group=MEMORY,
        metavar="auto|off|DIR",
    ),
    Option(
        "prompt_cache_ram",
        None,
        "the prompt cache's memory, counted in the plan (default: 512MiB without --memory-budget, none under one)",
        group=MEMORY,
        metavar="SIZE",
    ),
    Option(
        "kv_dtype",
        "f16",
        "every KV cache's keys and values (the draft's too): f16, rounded to nearest, half the memory of f32 (as "
        "llama.cpp's default); f32; q8, as llama.cpp's q8_0 (blocks of 32 int8 and a half scale), 0.27 of f32's; "
        "every speculative mode writes what the target alone writes at the same dtype",
        choices=KV_DTYPES,
        group=MEMORY,
    ),
    Option(
        "draft_kv_dtype",
        None,
        "the draft model's KV caches (default: --kv-dtype's; under a budget too small for the draft, q8 where that "
        "keeps it): the draft only proposes, so the text is the target's whatever they hold",
        choices=KV_DTYPES,
        group=MEMORY,
    ),
    Option(
        "ffn_density",
        0.3,
        "--mode flash: the share of each layer's FFN neurons a token computes (1.0: all of them, exactly the target)",
        kind=float,
        group=MEMORY,
    ),
    Option("chain_k", TreeConfig.chain_k, "chain mode: draft tokens per verification", kind=int, group=SPECULATION),
    Option(
        "branch_threshold",
        TreeConfig.branch_threshold,
        "tree mode: a candidate with at least this draft probability opens a branch",
        kind=float,
        group=SPECULATION,
    ),
    Option(
        "tree_growth",
        TreeConfig.growth,
        "tree mode, greedy: how a draft tree grows. best: the candidates of the greatest cumulative draft "
        "probability first, two per draft forward (four for a 32-wide tree; EAGLE-2's dynamic tree); pacer: LLMCad's branch pacer, a "
        "fed node's top child always and a sibling above --branch-threshold, until Tc < alpha; auto: best where a "
        "budgeted run verifies a tree whose width the disk hides (it accepts more at the same price), else the "
        "pacer (resident, a draft forward's price counts: the pacer's trees cost fewer)",
        choices=GROWTHS,
        group=SPECULATION,
    ),
    Option(
        "alpha", TreeConfig.alpha, "initial fallback threshold (verify when Tc < alpha)", kind=float, group=SPECULATION
    ),
    Option("no_trie", False, "tree mode: no Lookahead trie candidates", kind=bool, group=SPECULATION),
    Option("fixed_width", False, "always use the full width (no adaptive governor)", kind=bool, group=SPECULATION),
    Option(
        "draft_ahead",
        "auto",
        "draft forwards the draft may run while the target verifies (LLMCad's speculative "
        f"drafting during verification, greedy, over the actors); auto: up to {AUTO_AHEAD}, only while the streamed "
        "target keeps the verifier waiting on the disk (beside a busy verifier on 2 cores it slows it more than it "
        "saves, BENCHMARKS.md); 0: never",
        group=SPECULATION,
    ),
    Option(
        "draft_window",
        PROMPT_WINDOW,
        "the draft runs on the prompt's last N tokens only (0: the whole prompt); "
        "its prefill costs about a draft step per token on a CPU",
        kind=int,
        group=SPECULATION,
        metavar="N",
    ),
    Option(
        "profile",
        None,
        "an ARCA profile (launch profile --out): its width, tree and partition",
        group=SPECULATION,
        metavar="PROFILE.json",
    ),
    Option(
        "draft_vocab",
        None,
        "the draft proposes only the N most frequent tokens (FR-Spec: its output head keeps N "
        "rows); default 32768; 0: the whole vocabulary",
        kind=int,
        group=MEMORY,
        metavar="N",
    ),
    Option(
        "expert_eviction",
        "lru",
        "which expert leaves the buffer first: least recently used, EdgeMoE's score "
        "(activation frequency x how soon its layer runs), or none: no buffer, every expert read when used",
        choices=("lru", "edgemoe", "none"),
        group=EXPERTS,
    ),
    Option(
        "expert_preload",
        "none",
        "read the next layer's likely experts while this one computes: paths: EdgeMoE's "
        "path statistics (launch models profile-experts), router: the next layer's router on this layer's input; "
        "none: LRU alone was fastest on a 2-core CPU (BENCHMARKS.md)",
        choices=("none", "paths", "router"),
        group=EXPERTS,
    ),
    Option("expert_preload_k", 2, "experts preloaded per layer", kind=int, group=EXPERTS, metavar="K"),
    Option(
        "sparse_worker",
        False,
        "split tree attention with the CPU sparse-attention actor; one core each",
        kind=bool,
        group=WORKER,
    ),
    Option(
        "worker_share",
        0.0,
        "with --sparse-worker: the share of the dense attention chunks the worker takes too",
        kind=float,
        group=WORKER,
    ),
    Option(
        "column_share",
        0.0,
        "with --sparse-worker: the share of every target linear layer's output columns the "
        "worker computes in multi-token passes (Ghidorah's column split; the target must be resident)",
        kind=float,
        group=WORKER,
    ),
    Option(
        "trace_dir",
        None,
        "the folder for the Chrome trace (default: ./traces if it exists, else $CADENCE_HOME/traces)",
        group=OUTPUT,
    ),
    Option("no_trace", False, "write no trace", kind=bool, group=OUTPUT),
)

BY_NAME = {o.name: o for o in OPTIONS}
DEFAULTS = {o.name: o.default for o in OPTIONS}


def argv(options: dict) -> list[str]:
    """The command-line flags that give `options` (those that differ from the defaults): how a benchmark
    hands a run's options to `launch run` in a child process."""
    out = []
    for name, value in options.items():
        o = BY_NAME[name]
        if value == o.default:
            continue
        if o.kind is bool:
            out.append(o.flag)
        else:
            out += [o.flag, str(value)]
    return out
