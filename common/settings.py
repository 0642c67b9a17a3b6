"""The settings and results of a generation, with no torch: the scheduler process imports these
and never torch, so the runtime's fixed memory stays small (the model processes import torch once,
in the zygote, and share its pages).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from common.modes import Mode
from common.errors import CadenceError

# weight formats of a store (models/linear.py); int2: the FFN's weights in 2 bits, the rest in int4 (a draft
# model for a tight budget: the 0.5B's weights 215 -> 142 MiB)
FORMATS = ("fp32", "bf16", "fp16", "int8", "int4", "int2")
GROUP_SIZES = (32, 64)  # int2 and int4 groups: 64 shares one sub-scale and minimum across two groups of 32


def check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise CadenceError(f"weight format '{fmt}' is not known; use one of {', '.join(FORMATS)}")
    return fmt


@dataclass(frozen=True)
class SamplingConfig:
    """How a generation chooses its tokens (models/sampling.py): penalties on the recent text, then greedy
    (temperature 0) or a draw from softmax(logits / temperature) kept to its top_k, top_p nucleus and min_p. The
    draw for the token at position n is the Gumbel-max of its distribution under noise fixed by (seed, n), so a
    seed gives the same text alone or in a batch, and in every mode: a tree's node takes the token the target
    alone would take there."""

    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0
    top_k: int = 0  # 0: every token
    min_p: float = 0.0  # drop tokens below min_p times the likeliest's probability
    presence_penalty: float = 0.0  # subtracted from a token's logit once it is in the window
    frequency_penalty: float = 0.0  # subtracted once for each time it is in the window
    repetition_penalty: float = 1.0  # a windowed token's logit divided by it (multiplied where negative)
    repeat_last_n: int = 64  # the window the penalties look at: the text's last this many tokens (-1: all)
    grammar: str = (
        ""  # what follows the prompt is held to it: an llguidance grammar (speculative/grammar.py `grammar_of`)
    )
    logprobs: int = -1  # with each token its log-probability and this many likeliest tokens' (-1: none)
    prompt_logprobs: bool = False  # ... and with each prompt token's too (its whole prompt prefilled, none reused)

    def __post_init__(self):
        checks = (
            (self.temperature >= 0, "temperature", "must be >= 0 (0 means greedy)"),
            (0 < self.top_p <= 1, "top_p", "must be in (0, 1]"),
            (self.top_k >= 0, "top_k", "must be >= 0 (0: every token)"),
            (0 <= self.min_p <= 1, "min_p", "must be in [0, 1]"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]"),
            (self.repetition_penalty > 0, "repetition_penalty", "must be > 0 (1: none)"),
            (self.repeat_last_n >= -1, "repeat_last_n", "must be >= -1 (-1: the whole text, 0: none)"),
            (-1 <= self.logprobs <= MAX_LOGPROBS, "logprobs", f"must be in [-1, {MAX_LOGPROBS}] (-1: none)"),
            (not self.prompt_logprobs or self.logprobs >= 0, "prompt_logprobs", "needs logprobs >= 0"),
        )
        for ok, name, rule in checks:
            if not ok:
                raise CadenceError(f"{name}={getattr(self, name)} {rule}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Penalties change the logits (they read each row's own recent text)."""
        return self.repeat_last_n != 0 and (
            self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
        )

    @property
    def plain(self) -> bool:
        """Each token is its row's argmax: no draw, no penalty, no grammar, no log-probabilities asked for (a forward
        may give the argmax alone)."""
        return self.greedy and not self.penalized and not self.grammar and self.logprobs < 0


MAX_LOGPROBS = 20  # the most likeliest tokens a token's log-probabilities come with (OpenAI's `top_logprobs` bound)
SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingConfig))  # also the options', the API's and a request's names
TOP_K = 4  # candidates looked at per expansion
DRAFT_ROWS = 2  # a best-first tree runs the draft on at most this many times its budget's nodes (bestfirst.py)
CATCH_UP = 8  # after plain target steps, the draft runs on at most this many of the tokens it missed
WIDER = (32, 16)  # the widths a budgeted run tries, widest first, where this machine verifies that many rows while
# the disk reads (engine/decide.py `_settle_width`)
PROMPT_WINDOW = 64  # the draft runs on at most the last this many prompt tokens (0: the whole prompt)


GROWTHS = ("auto", "best", "pacer")  # how a greedy draft tree grows (speculative/bestfirst.py, speculative/policy.py)


@dataclass(frozen=True)
class TreeConfig:
    mode: Mode = Mode.TREE  # the speculation's shape: Mode.TREE or Mode.CHAIN (a run's `Mode.shape`)
    width: int = 8  # most draft tokens in one verification
    width_auto: bool = (
        False  # not given: under a budget, one of WIDER where verification hides behind the disk (engine/memory.py)
    )
    max_depth: int = 8
    branch_threshold: float = 0.3
    # greedy trees: "best" first by cumulative probability (EAGLE-2), LLMCad's "pacer", or "auto": best where a
    # budgeted run verifies a tree whose width the disk hides (engine/decide.py `_settle_width`), else the pacer
    growth: str = "auto"
    alpha: float = 0.01
    chain_k: int = 4  # chain mode: draft tokens per verification
    trie: bool = True  # tree mode: add Lookahead trie candidates from the prompt and output n-grams
    trie_nodes: int = 4  # at most this many trie candidates per tree
    adaptive: bool = True  # let the governor pick each cycle's budget (0 = plain target step)
    ahead: int = 0  # greedy: draft forwards the draft may run while the target verifies (LLMCad 3.4)
    # ... only while the verifier measurably waits on the loader (the cores are free then): `ahead` is
    # the most per verification, and a run whose target is resident never drafts ahead
    ahead_auto: bool = False
    prompt_window: int = PROMPT_WINDOW  # the draft's view of the prompt: its last this many tokens (0: all)
    # an ARCA tree shape (launch profile): a fixed tree of draft ranks instead of LLMCad's dynamic tree
    shape_parents: tuple = ()
    shape_ranks: tuple = ()

    def __post_init__(self):
        if self.mode not in (Mode.TREE, Mode.CHAIN):
            raise CadenceError(f"tree mode '{self.mode}' must be tree or chain")
        object.__setattr__(self, "mode", Mode(self.mode))
        if not 1 <= self.width <= 64:
            raise CadenceError(f"verification width {self.width} must be within 1..64")
        if self.max_depth < 1 or self.chain_k < 1:
            raise CadenceError("max_depth and chain_k must be at least 1")
        if self.growth not in GROWTHS:
            raise CadenceError(f"tree growth '{self.growth}' must be one of {', '.join(GROWTHS)}")
        if not 0 < self.branch_threshold <= 1:
            raise CadenceError(f"branch_threshold={self.branch_threshold} must be in (0, 1]")
        if not 0 <= self.alpha < 1:
            raise CadenceError(f"alpha={self.alpha} must be in [0, 1)")
        if not 0 <= self.ahead <= 64:
            raise CadenceError(f"draft-ahead steps {self.ahead} must be within 0..64")
        if self.prompt_window < 0:
            raise CadenceError(f"the draft's prompt window {self.prompt_window} must be 0 (the whole prompt) or more")

    @property
    def budget(self) -> int:
        return self.chain_k if self.mode is Mode.CHAIN else self.width


PREFILL_CHUNK = 256  # prompt rows per forward (speculative/verify.py; scheduler/generation/memplan.py plans for it)
PROMPT_LOGPROBS_CHUNK = 16  # ... where every row's logits are kept (a prompt's log-probabilities): within its room

_ARM_ORDER = {"lookup": 0, "plain": 1, "draft": 2}


@dataclass(frozen=True)
class Arm:
    """What one speculation cycle does, one of the governor's choices: a plain target step ("plain"),
    the trie's candidates verified alone with no draft forward ("lookup", prompt lookup), or a draft
    tree of at most `size` tokens ("draft"). Ordered lookup < plain < the draft sizes ascending: the
    governor tries an arm's neighbours in that order."""

    kind: str
    size: int = 0

    def __post_init__(self):
        if self.kind not in _ARM_ORDER or (self.kind == "draft") != (self.size > 0):
            raise ValueError(f"an arm is plain, lookup or a draft of at least one token; got {self.kind} {self.size}")

    def __lt__(self, other: "Arm") -> bool:
        return (_ARM_ORDER[self.kind], self.size) < (_ARM_ORDER[other.kind], other.size)

    def __str__(self) -> str:
        return f"draft{self.size}" if self.kind == "draft" else self.kind


PLAIN = Arm("plain")
LOOKUP = Arm("lookup")


def arms(cfg: TreeConfig, draft_model: bool = True) -> tuple[Arm, ...]:
    """The arms the governor chooses among: the plain step, draft trees of even sizes up to the run's
    budget (chain: 1 too), and in tree mode with the trie, prompt lookup. No draft model: lookup or plain."""
    if not draft_model:
        return (LOOKUP, PLAIN)
    sizes = (
        set(range(1, cfg.chain_k + 1))
        if cfg.mode is Mode.CHAIN
        else {2, 4, cfg.width} | set(range(2, cfg.width + 1, 2))
    )
    lookup = (LOOKUP,) if cfg.mode is Mode.TREE and cfg.trie else ()
    return (*lookup, PLAIN, *(Arm("draft", n) for n in sorted(sizes)))


@dataclass(frozen=True)
class ExpertOptions:
    """How a mixture of experts keeps its expert buffer under a budget (scheduler/generation/experts.py)."""

    eviction: str = "lru"  # lru | edgemoe | none (loading on demand, no buffer)
    preload: str = "none"  # none | paths (EdgeMoE's path statistics) | router (next-router lookahead)
    preload_k: int = 2  # experts preloaded per layer

    def __post_init__(self):
        if self.eviction not in ("lru", "edgemoe", "none") or self.preload not in ("none", "paths", "router"):
            raise CadenceError(
                f"--expert-eviction {self.eviction} / --expert-preload {self.preload}: eviction is lru, "
                "edgemoe or none; preload is none, paths or router"
            )
        if self.preload_k < 1:
            raise CadenceError(f"--expert-preload-k {self.preload_k} must be at least 1")

    @property
    def label(self) -> str:
        return f"{self.eviction}+{self.preload}"


@dataclass(frozen=True)
class PromptCacheConfig:
    """The prompt cache a run keeps (speculative/prefixes.py): entries in memory up to `ram_bytes` (counted in the
    plan), and on disk in `dir` (None: none) up to `disk_bytes` (0: the larger of memory's and 1 GiB)."""

    ram_bytes: int = 0
    dir: str | None = None
    disk_bytes: int = 0

    @property
    def disk_bound(self) -> int:
        """What the entries on disk may hold: `disk_bytes`, else the larger of memory's and 1 GiB."""
        return self.disk_bytes or max(self.ram_bytes, 1 << 30)


@dataclass(frozen=True)
class WorkerSplit:
    """What the sparse-attention worker takes of each multi-row pass (Ghidorah): the tree part of every
    layer's attention, `share` of the dense attention chunks, the last `columns` of every target linear
    layer's output columns."""

    share: float = 0.0
    columns: float = 0.0

    def __post_init__(self):
        if not 0.0 <= self.share < 1.0 or not 0.0 <= self.columns < 1.0:
            raise CadenceError(
                f"--worker-share and --column-share are shares in [0, 1); got {self.share} and {self.columns}"
            )


@dataclass
class SpecStats:
    """What a speculative run did; `as_dict` is what JSON rows carry in `stats`."""

    verifications: int = 0
    plain_steps: int = 0
    accepted: int = 0  # draft tokens the target confirmed
    drafted: int = 0  # draft tokens proposed (tree nodes)
    trie_drafted: int = 0
    draft_forwards: int = 0
    target_forwards: int = 1  # the prompt
    accepted_hist: dict[int, int] = field(default_factory=dict)
    arm_hist: dict[str, int] = field(default_factory=dict)  # cycles per governor arm
    arm_s: dict[str, float] = field(default_factory=dict)  # seconds per governor arm
    alpha: list[float] = field(default_factory=list)
    draft_s: float = 0.0
    verify_s: float = 0.0
    ahead_steps: int = 0  # draft forwards run during verification
    ahead_reused: int = 0  # tree nodes that came from them, fed already

    def record_verification(self, tree, path: list[int]):  # tree: a speculative.tree.Tree
        self.verifications += 1
        self.accepted += len(path)
        self.drafted += len(tree.tokens)
        self.trie_drafted += tree.trie_nodes
        self.draft_forwards += tree.forwards
        self.accepted_hist[len(path)] = self.accepted_hist.get(len(path), 0) + 1

    def as_dict(self) -> dict:
        v = max(self.verifications, 1)
        return {
            "verifications": self.verifications,
            "plain_steps": self.plain_steps,
            "accepted": self.accepted,
            "drafted": self.drafted,
            "wasted": self.drafted - self.accepted,
            "trie_drafted": self.trie_drafted,
            "draft_forwards": self.draft_forwards,
            "target_forwards": self.target_forwards,
            "mean_accepted": round(self.accepted / v, 3),
            "accepted_hist": {str(k): n for k, n in sorted(self.accepted_hist.items())},
            "arm_hist": dict(self.arm_hist),
            "arm_s": {k: round(v, 4) for k, v in self.arm_s.items()},
            "alpha": [round(a, 6) for a in self.alpha],
            "draft_s": round(self.draft_s, 4),
            "verify_s": round(self.verify_s, 4),
            "ahead_steps": self.ahead_steps,
            "ahead_reused": self.ahead_reused,
        }


@dataclass
class Generation:
    prompt_ids: list[int]
    new_ids: list[int]
    wall_s: float
    prefill_s: float
    stats: dict = field(default_factory=dict)
