"""The configuration of a run: one frozen dataclass with typed parts, built from the options
(engine/options.py) the same way at every front door and checked once: what the user asked. Every choice made
from it is made once, by engine/decide.py, into a `RunPlan` (engine/plan.py).

    cfg = RunConfig.from_options(target="qwen2.5-coder-1.5b", memory_budget="1GiB", width=12)
    cfg.tree.width, cfg.sampling.greedy, cfg.experts.eviction    # typed parts
    cfg.options()["width"]                                       # and back to the options
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from common.errors import CadenceError
from common.modes import MODES, Mode
from speculative.grammar import grammar_of
from common.settings import SAMPLING_FIELDS, ExpertOptions, SamplingConfig, TreeConfig, WorkerSplit, check_format
from engine.options import AUTO_AHEAD, BY_NAME, DEFAULTS, RUNTIMES
from common.units import parse_bytes
from models.shapes import KV_DTYPES


DEFAULT_NEW_TOKENS = 1024  # what `launch run` and `launch chat` write at most where --max-new-tokens is not given (a
# greedy small model may loop until its context is full); a server's requests and cadence.LLM say their own


@dataclass(frozen=True)
class RunConfig:
    target: str = DEFAULTS["target"]
    draft: str = "auto"  # a model, "none" (the trie alone), "flash", or "auto": decide picks
    dtype: str = "int4"
    draft_dtype: str | None = None  # None: the target's
    mode: Mode = Mode.TREE  # an option's text becomes the member
    max_new_tokens: int | None = None  # None: until the end of the turn or of the context
    context: int | None = None  # tokens a generation holds, prompt and answer; None: decide sizes it
    chat: str = "auto"
    sampling: SamplingConfig = SamplingConfig()
    tree: TreeConfig = field(default_factory=TreeConfig)
    memory_budget: str | None = None  # "3GiB", "auto", or None: no bound, everything resident
    # FR-Spec: the draft's head keeps only this many (most frequent) token rows; None: 32768 under a budget,
    # the whole vocabulary without one; 0: the whole vocabulary
    draft_vocab: int | None = None
    worker: WorkerSplit | None = None  # the sparse-attention worker, or None
    experts: ExpertOptions = ExpertOptions()
    runtime: str = "actors"
    ffn_density: float = 0.3  # --mode flash: the share of a layer's FFN neurons a token computes
    device: str = "cpu"
    threads: int = 0
    parallel: int = 1  # generations at once (speculative/batch.py), each with its own KV caches of `context`;
    # 0: as many as the memory allows (engine/memory.py `most_slots`)
    trace: bool = True
    trace_dir: str | None = None
    profile: str | None = None  # an ARCA profile; decide applies it (tree, worker)
    plan_sampling: bool = False  # plan room for sampling although the run's default is greedy (a server's requests)
    prompt_cache: str = "auto"  # auto, off, or a folder (speculative/prefixes.py; engine/memory.py `prompt_cache_of`)
    prompt_cache_ram: str | None = None  # its memory, e.g. "256MiB"; None: decide's
    kv_dtype: str = "f32"  # the engine's own (transformers' float caches); every door (engine/options.py) asks f16
    draft_kv_dtype: str | None = None  # the draft's caches' (None: kv_dtype's; a budget too small may make them q8)

    def __post_init__(self):
        if self.mode not in MODES:
            raise CadenceError(f"mode '{self.mode}' is not known; use one of {', '.join(MODES)}")
        object.__setattr__(self, "mode", Mode(self.mode))
        checks = (
            (self.runtime in RUNTIMES, f"runtime '{self.runtime}' is not known; use one of {', '.join(RUNTIMES)}"),
            *_kv_checks("--kv-dtype", self.kv_dtype, self.device),
            *_kv_checks("--draft-kv-dtype", self.draft_kv, self.device),
            (
                self.max_new_tokens is None or self.max_new_tokens >= 1,
                f"--max-new-tokens={self.max_new_tokens} must be at least 1",
            ),
            (self.context is None or self.context >= 2, f"--context={self.context} must be at least 2 tokens"),
            (self.chat in ("auto", "on", "off"), f"--chat={self.chat} must be auto, on or off"),
            (
                self.parallel >= 0,
                f"--parallel {self.parallel} must be at least 1 (generations at once), or 0: as many as memory allows",
            ),
            (self.threads >= 0, f"--threads {self.threads} is not a thread count; give a number, or 0 for all cores"),
            (
                not (self.draft == "none" and self.mode is Mode.CHAIN),
                "mode chain needs a draft model; with --draft none use --mode tree (the n-gram trie proposes)",
            ),
            (
                bool(self.draft) and bool(self.target),
                "--target and --draft name a model (--draft none: no draft model)",
            ),
            (
                not (self.runtime == "actors" and self.device != "cpu"),
                "the actor runtime runs on the CPU for now; use --runtime inproc with --device cuda",
            ),
            (
                not (self.mode.streamed and not self.memory_budget),
                f"mode {self.mode} streams the target under a memory budget: give --memory-budget (e.g. auto)",
            ),
            (0.0 < self.ffn_density <= 1.0, f"--ffn-density {self.ffn_density} must be above 0 and at most 1"),
            (
                not (self.memory_budget and self.runtime != "actors" and self.mode is not Mode.FLASH),
                "--memory-budget needs the actor runtime (the I/O loader is an actor); drop --runtime inproc",
            ),
            (
                not (self.worker and self.worker.columns > 0 and self.memory_budget),
                "--column-share needs every target layer resident (the worker maps the target's weights itself); "
                "drop --memory-budget or --column-share",
            ),
            (not (self.worker and self.runtime != "actors"), "--sparse-worker is an actor; drop --runtime inproc"),
            (
                self.draft_vocab is None or self.draft_vocab >= 0,
                f"--draft-vocab={self.draft_vocab} must be 0 (the whole vocabulary) or a number of tokens",
            ),
            (
                not (self.memory_budget and self.mode is Mode.TARGET),
                "mode target keeps the whole target in memory; under --memory-budget use std, stdpl, chain or tree",
            ),
            (
                self.tree.mode is self.mode.shape,
                f"the tree settings are for mode {self.tree.mode}, the run's mode is {self.mode}",
            ),
        )
        for ok, why in checks:
            if not ok:
                raise CadenceError(why)
        check_format(self.dtype)
        if self.draft_dtype is not None:
            check_format(self.draft_dtype)
        if self.memory_budget not in (None, "auto"):
            parse_bytes(self.memory_budget)  # a unit it does not know ends here, before any model is read

    # -- the options ------------------------------------------------------------------------------

    @classmethod
    def from_options(cls, **options) -> RunConfig:
        """The configuration the options (engine/options.py) give; a name that is not an option ends
        in one sentence that lists them."""
        unknown = sorted(set(options) - set(BY_NAME))
        if unknown:
            raise CadenceError(f"unknown option(s) {', '.join(unknown)}; the options are {', '.join(BY_NAME)}")
        o = {**DEFAULTS, **options}
        mode = Mode(o["mode"]) if o["mode"] in MODES else o["mode"]  # an unknown one: refused by __post_init__
        tree = TreeConfig(
            mode=mode.shape if isinstance(mode, Mode) else Mode.TREE,
            width=o["width"] or TreeConfig.width,
            width_auto=not o["width"],
            chain_k=o["chain_k"],
            branch_threshold=o["branch_threshold"],
            growth=o["tree_growth"],
            alpha=o["alpha"],
            trie=not o["no_trie"],
            adaptive=not o["fixed_width"],
            ahead=_ahead(o["draft_ahead"]),
            ahead_auto=str(o["draft_ahead"]) == "auto",
            prompt_window=o["draft_window"],
        )
        worker = None
        if o["sparse_worker"]:
            worker = WorkerSplit(o["worker_share"], o["column_share"])
        elif o["worker_share"] or o["column_share"]:
            raise CadenceError(
                "--worker-share and --column-share give work to the sparse-attention worker; add --sparse-worker"
            )
        return cls(
            target=o["target"],
            draft=o["draft"],
            dtype=o["dtype"],
            draft_dtype=o["draft_dtype"],
            mode=mode,
            max_new_tokens=o["max_new_tokens"],
            context=o["context"],
            chat=o["chat"],
            sampling=SamplingConfig(**{k: o[k] for k in SAMPLING_FIELDS} | {"grammar": grammar_of(o["grammar"])}),
            tree=tree,
            memory_budget=o["memory_budget"],
            draft_vocab=o["draft_vocab"],
            worker=worker,
            experts=ExpertOptions(o["expert_eviction"], o["expert_preload"], o["expert_preload_k"]),
            runtime=o["runtime"],
            ffn_density=o["ffn_density"],
            device=o["device"],
            threads=o["threads"],
            parallel=o["parallel"],
            trace=not o["no_trace"],
            trace_dir=o["trace_dir"],
            profile=o["profile"],
            prompt_cache=o["prompt_cache"],
            prompt_cache_ram=o["prompt_cache_ram"],
            kv_dtype=o["kv_dtype"],
            draft_kv_dtype=o["draft_kv_dtype"],
        )

    def options(self) -> dict:
        """The options that give this configuration: `RunConfig.from_options(**cfg.options()) == cfg`."""
        t, s, w, e = self.tree, self.sampling, self.worker or WorkerSplit(), self.experts
        return {
            "target": self.target,
            "mode": self.mode.value,
            "memory_budget": self.memory_budget,
            "max_new_tokens": self.max_new_tokens,
            **{k: getattr(s, k) for k in SAMPLING_FIELDS},
            "draft": self.draft,
            "dtype": self.dtype,
            "draft_dtype": self.draft_dtype,
            "chat": self.chat,
            "context": self.context,
            "threads": self.threads,
            "parallel": self.parallel,
            "kv_dtype": self.kv_dtype,
            "draft_kv_dtype": self.draft_kv_dtype,
            "device": self.device,
            "runtime": self.runtime,
            "ffn_density": self.ffn_density,
            "width": 0 if t.width_auto else t.width,
            "chain_k": t.chain_k,
            "branch_threshold": t.branch_threshold,
            "tree_growth": t.growth,
            "alpha": t.alpha,
            "no_trie": not t.trie,
            "fixed_width": not t.adaptive,
            "draft_ahead": "auto" if t.ahead_auto else str(t.ahead),
            "draft_window": t.prompt_window,
            "profile": self.profile,
            "draft_vocab": self.draft_vocab,
            "expert_eviction": e.eviction,
            "expert_preload": e.preload,
            "expert_preload_k": e.preload_k,
            "sparse_worker": self.worker is not None,
            "worker_share": w.share,
            "column_share": w.columns,
            "trace_dir": self.trace_dir,
            "no_trace": not self.trace,
            "prompt_cache": self.prompt_cache,
            "prompt_cache_ram": self.prompt_cache_ram,
        }

    def replace(self, **kw) -> RunConfig:
        return dataclasses.replace(self, **kw)

    def with_mode(self, mode: Mode | str, **kw) -> RunConfig:
        """The same run in another mode (the same models; `kw`: other fields changed with it): its tree
        settings follow."""
        return self.replace(mode=Mode(mode), tree=dataclasses.replace(self.tree, mode=Mode(mode).shape), **kw)

    # -- what follows from it -----------------------------------------------------------------------

    @property
    def speculative(self) -> bool:
        return self.mode.speculative

    @property
    def draft_model(self) -> str | None:
        """The draft model asked for: None in target-only modes, with --draft none, flash or auto (what `auto`
        takes is decide's: engine/decide.py)."""
        return self.draft if self.speculative and self.draft not in ("none", "auto", "flash") else None

    @property
    def draft_format(self) -> str:
        return self.draft_dtype or self.dtype

    @property
    def draft_kv(self) -> str:
        """The draft's KV caches' keys and values: --draft-kv-dtype, else --kv-dtype's."""
        return self.draft_kv_dtype or self.kv_dtype


def _kv_checks(flag: str, dtype: str, device: str) -> tuple:
    """(ok, why) of a KV caches' dtype option: one cadence knows, and q8 only on its CPU kernels."""
    return (
        (dtype in KV_DTYPES, f"{flag} {dtype} is not known; use one of {', '.join(KV_DTYPES)}"),
        (
            not (dtype == "q8" and device != "cpu"),
            f"{flag} q8 runs on cadence's CPU kernels; use f16 with --device cuda",
        ),
    )


def _ahead(value) -> int:
    if str(value) == "auto":
        return AUTO_AHEAD
    try:
        return int(value)
    except ValueError:
        raise CadenceError(f"--draft-ahead {value} is neither auto nor a number of draft steps") from None
