"""What a run will do, decided once (engine/decide.py `decide`) and frozen: the `RunPlan`.

`RunConfig` (engine/config.py) is what the user asked: strings such as `draft="auto"` and
`memory_budget="0.75GiB"`. A `RunPlan` is what was decided from it on this machine: the mode and the
draft as enums, the weight stores, the tree's width and growth, the context in tokens, the budget in
bytes, the memory plan (scheduler/generation/memplan.py), the scheduler's settings, and the lines that
say why a choice was made (`notes`). Everything after `decide` reads the plan; nothing re-reads an option
string or re-parses a budget.

    plan = decide(RunConfig.from_options(memory_budget="768MiB"), ThisMachine())
    plan.draft.kind, plan.tree.width, plan.budget, plan.memory.read_per_forward
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import StrEnum

from common.modes import Mode
from common.settings import ExpertOptions, PromptCacheConfig, SamplingConfig, TreeConfig, WorkerSplit
from engine.config import RunConfig
from engine.options import DEFAULTS
from formats.store import WeightStore
from scheduler.runtime_config import RuntimeConfig


class DraftKind(StrEnum):
    MODEL = "model"  # a draft model, in the format asked (or the target's)
    LEAN = "lean"  # the draft `auto` picked, made leaner (int2 FFN, a cut head) to fit the budget
    FLASH = "flash"  # the target's own sparse FFN drafts (flash/sparse_target.py)
    TRIE = "trie"  # no draft model: the n-gram trie of the prompt and the output proposes
    NONE = "none"  # a target-only mode drafts nothing


class Runtime(StrEnum):
    ACTORS = "actors"  # the verifier and draft as actor processes under the scheduler
    INPROC = "inproc"  # the same cycle in this process


@dataclass(frozen=True)
class DraftPlan:
    kind: DraftKind
    name: str | None = None  # the model's name as given (MODEL, LEAN)
    store: WeightStore | None = None  # its weights (MODEL, LEAN; FLASH: the target's)
    format: str | None = None  # its weight format
    head_rows: int = 0  # FR-Spec: the token rows its head keeps (0: all)
    flash: tuple[float, str, int] | None = None  # FLASH: (FFN density, predictor, neurons a layer cached)
    kv_dtype: str = "f32"  # its KV caches' keys and values (--draft-kv-dtype, else the run's --kv-dtype)

    @property
    def model(self) -> bool:
        """A draft model loaded beside the target (MODEL or LEAN)."""
        return self.kind in (DraftKind.MODEL, DraftKind.LEAN)


@dataclass(frozen=True)
class RunPlan:
    asked: RunConfig  # the options as the user gave them (what a row or a metric reports as asked)
    mode: Mode
    target_name: str
    target: WeightStore
    format: str  # the target's weight format
    draft: DraftPlan
    tree: TreeConfig  # the width and growth decided (a profile's shape, a wider tree the disk hides)
    sampling: SamplingConfig
    context: int  # tokens a generation holds, prompt and answer
    max_new_tokens: int | None
    chat: str  # auto, on, off
    runtime: Runtime
    device: str
    threads: int  # the cores the models' kernels use
    parallel: int  # generations at once (speculative/batch.py), each a slot with KV caches of `context` tokens
    budget: int | None = None  # bytes; None: no bound, everything resident
    memory: object = None  # the memory plan (scheduler/generation/memplan.py MemoryPlan) under a budget
    scheduler: RuntimeConfig | None = None  # the actor runtime's settings (budget per role, arena, slots)
    worker: WorkerSplit | None = None  # the sparse-attention worker, or None
    experts: ExpertOptions = ExpertOptions()
    paths: object = None  # a mixture of experts' path profile (scheduler/generation/expert_policy.py), or None
    ffn_density: float = 0.3  # --mode flash
    trace: bool = True
    trace_dir: str | None = None
    notes: tuple[str, ...] = ()  # a line per choice made for the user (the draft `auto` took, a wider tree)
    prompt_cache: PromptCacheConfig | None = None  # prompts' rows kept past their slot (speculative/prefixes.py)
    kv_dtype: str = "f32"  # the KV caches' keys and values (--kv-dtype; models/kvcache.py)

    @property
    def speculative(self) -> bool:
        return self.mode.speculative

    @property
    def budget_auto(self) -> bool:
        """The budget was asked as `auto` (flash: its session sizes the caches; else the memory plan did)."""
        return self.asked.memory_budget == "auto"

    @property
    def approximate(self) -> bool:
        return self.mode is Mode.FLASH

    def with_mode(self, mode: Mode) -> RunPlan:
        """The same run in another mode of the models it loaded (a benchmark's or a request's): its tree follows."""
        mode = Mode(mode)
        tree = dataclasses.replace(self.tree, mode=mode.shape)
        return dataclasses.replace(self, mode=mode, tree=tree)

    def for_generation(self, max_new_tokens: int | None, sampling: SamplingConfig | None) -> RunPlan:
        return dataclasses.replace(
            self, max_new_tokens=max_new_tokens or self.max_new_tokens, sampling=sampling or self.sampling
        )

    def options(self) -> dict:
        """The options as given, with what was decided in place of `auto`: the draft, the context, the width."""
        d = self.draft
        draft = d.name if d.model else "flash" if d.kind is DraftKind.FLASH else "none"
        return {
            **self.asked.options(),
            "draft": draft if self.speculative else self.asked.draft,
            "context": self.context,
            "width": 0 if self.tree.width_auto else self.tree.width,
        }

    def prefixes(self):
        """The prompt cache of a target in this process (speculative/prefixes.py), or None."""
        from speculative.prefixes import prompt_cache

        pc = self.prompt_cache
        return prompt_cache(None if pc is None else dataclasses.asdict(pc), str(self.target.dir), self.kv_dtype)

    def local_cycle(self, target, draft, prefixes=None):
        """The speculation cycle over a target model in this process and a draft side (or None); `prefixes`: the
        target's prompt cache (speculative/prefixes.py), or None."""
        from speculative.loop import Speculation
        from speculative.verify import LocalTarget

        return Speculation(
            LocalTarget(target, prefixes),
            draft,
            self.mode,
            self.tree,
            self.sampling,
            self.context,
            self.target.args.context_length,
        )

    # -- what it says --------------------------------------------------------------------------------

    def draft_words(self, fmt_: bool = False) -> str:
        """ ", draft NAME" (`fmt_`: and its format), ", draft flash (...)", ", no draft model" (a speculative mode:
        the n-gram trie proposes) or "" (target-only)."""
        d = self.draft
        if not self.speculative:
            return ""
        if d.model:
            kv = f" (its KV in {d.kv_dtype})" if fmt_ and d.kv_dtype != self.kv_dtype else ""
            return f", draft {d.name}" + (f" {d.format}{kv}" if fmt_ else "")
        if d.kind is DraftKind.FLASH:
            return f", draft flash (the target's own FFN at density {self.ffn_density:g})"
        return ", no draft model"

    def describe(self) -> str:
        """The run in one line: its models, context and runtime, and every option it was given that is not the
        default (what a user checks to see that an option reached the run)."""
        given = {
            k: v
            for k, v in self.asked.options().items()
            if v != DEFAULTS[k] and k not in ("target", "mode", "dtype", "draft", "context")
        }
        if not self.tree.width_auto and self.asked.tree.width_auto:  # decided here, not asked
            given["width"] = self.tree.width
        if given.get("grammar"):  # the compiled grammar is long: its size says that one reached the run
            given["grammar"] = f"({len(given['grammar'])} bytes)"
        extra = "; " + " ".join(f"{k}={v}" for k, v in given.items()) if given else ""
        slots = f"{self.parallel} slots of " if self.parallel > 1 else ""
        return (
            f"{self.mode} {self.target_name} {self.format}{self.draft_words()}; context {slots}{self.context} tokens; "
            f"{self.runtime}{extra}"
        )

    def summary(self) -> str:
        """What `launch run` prints at start: the run's line, and its memory plan's under a budget."""
        return self.describe() + ("\n" + self.memory.summary() if self.memory is not None else "")

    def headline(self) -> str:
        """The first line of `launch plan`: the models and what the KV caches are sized for."""
        new = f"up to {self.max_new_tokens} new" if self.max_new_tokens else "prompt and answer"
        head = f"{self.mode} {self.target_name} {self.format}{self.draft_words(fmt_=True)}"
        kv = "KV" if self.kv_dtype == "f32" else f"{self.kv_dtype} KV"  # (--kv-dtype)
        pool = f"{'an' if self.kv_dtype == 'f16' else 'a'} {kv} pool"
        if self.parallel > 1:  # speculative/kvpool.py: each generation takes the rows it needs of the slots' pool
            most = min(self.target.args.context_length, self.parallel * self.context)
            return (
                f"{head}; {self.parallel} slots (--parallel) sharing {pool} of {self.parallel} x {self.context} "
                f"tokens (a generation takes what it needs, up to {most}; {new})"
            )
        return f"{head}; {kv} caches for a context of {self.context} tokens ({new})"
