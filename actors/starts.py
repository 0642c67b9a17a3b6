"""What each actor starts with: its part of the run's plan, typed. The scheduler builds one at spawn
(scheduler/generation/session.py) and sends it once as the map of its fields; the actor reads it back at the
boundary (actors/calls.py `record`): a field missing, unknown or of the wrong type fails the start in one sentence
that names it, as an op's arguments do. Torch-free: the scheduler imports it."""

from __future__ import annotations

from dataclasses import dataclass

from common.settings import PromptCacheConfig, SamplingConfig, TreeConfig, WorkerSplit


@dataclass(frozen=True)
class ExpertRequests:
    """A mixture of experts under a budget: the most experts a request asks for at once (the buffer's slots), and
    whether a layer's router guesses the next layer's experts for the buffer to preload."""

    batch: int
    lookahead: bool = False


@dataclass(frozen=True)
class VerifierStart:
    """The target model: its weight store, whole or (`resident` given) streamed with those groups kept."""

    store: str
    sampling: SamplingConfig  # the run's (a request may bring its own)
    kv_dtype: str = "f32"
    threads: int | None = None  # None: torch's own count
    resident: list | None = None  # streamed: the groups kept in memory, the others read by the loader
    experts: ExpertRequests | None = None
    worker: WorkerSplit | None = None  # the sparse-attention worker's share (it then runs on a core of its own)
    prompt_cache: PromptCacheConfig | None = None
    name: str = ""


@dataclass(frozen=True)
class FlashDraft:
    """`--draft flash`: the target's attention and head, its FFN from neuron caches (flash/sparse_target.py)."""

    density: float
    predictor: str
    capacity: int


@dataclass(frozen=True)
class DraftStart:
    """The draft model, resident: its store (the target's, with `flash`), and the run's tree settings."""

    store: str
    sampling: SamplingConfig
    tree: TreeConfig
    kv_dtype: str = "f32"
    threads: int | None = None
    head_rows: int | None = None  # its head cut to the most frequent tokens (None: whole)
    flash: FlashDraft | None = None
    name: str = ""


@dataclass(frozen=True)
class LoaderStart:
    """The loader: the target's store, read into the streaming slots of `stream_bytes` of the arena."""

    store_dir: str
    stream_bytes: int | None = None
    threads: int = 4
    chunk_bytes: int | None = None  # None: the reader's own (shm/dio.py)
    direct: bool = True


@dataclass(frozen=True)
class SparseStart:
    """The sparse-attention worker: the target's shape (models/args.py `ModelArgs` as its fields) and store, and the
    share of every linear layer's output columns it computes (0: attention only)."""

    model: dict
    store: str
    columns: float = 0.0
    kv_dtype: str = "f32"
    threads: int = 1
