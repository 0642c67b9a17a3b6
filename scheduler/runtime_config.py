"""The runtime's configuration: one frozen object with nested parts.

Every part checks itself in `__post_init__` and names the field and the value it rejects.
argparse lives only in `launch/`; it builds these.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from common.errors import CadenceError

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


class ConfigError(CadenceError, ValueError):
    """A configuration value that cannot work."""


def _require(ok: bool, name: str, value, what: str) -> None:
    if not ok:
        raise ConfigError(f"{name} must be {what}, got {value!r}")


def _positive(part: str, obj, *names: str) -> None:
    for n in names:
        v = getattr(obj, n)
        _require(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0, f"{part}.{n}", v, "> 0")


@dataclass(frozen=True)
class Timeouts:
    """Seconds. Each timeout error names the field to raise."""

    hello_s: float = 60.0  # process start -> HELLO (interpreter start and imports)
    init_s: float = 120.0  # INIT -> READY (the actor's heavy setup: loading weights)
    ready_s: float = 180.0  # `wait_ready`: every actor spawned together is READY
    request_s: float = 60.0  # `call`, a streamed load, a split layer: a request -> its reply
    heartbeat_s: float = 30.0  # silence after which a READY actor counts as hung (longer than any step)
    shutdown_s: float = 1.0  # STOP -> exit, before the process tree is killed

    def __post_init__(self):
        _positive("timeouts", self, "hello_s", "init_s", "ready_s", "request_s", "heartbeat_s", "shutdown_s")

    @property
    def heartbeat_every_s(self) -> float:
        """How often actors send a heartbeat: several per heartbeat_s, at least once a second."""
        return min(self.heartbeat_s / 4, 1.0)


@dataclass(frozen=True)
class MemoryConfig:
    budget_bytes: int = 8 * GiB  # everything the run may hold: processes + arena
    arena_bytes: int = 64 * MiB  # the shared arena: streaming slots + tensor exchange
    stream_bytes: int = 32 * MiB  # the part of the arena the loader may fill: its memory bound
    expert_bytes: int = 0  # the end of that part kept for a mixture of experts' expert buffer
    role_bytes: dict = field(default_factory=dict)  # planned bytes per role (weights, KV, activations)
    sample_s: float = 1.0  # live USS/PSS sampling period; 0 turns it off

    def __post_init__(self):
        _positive("memory", self, "budget_bytes", "arena_bytes")
        _require(
            type(self.stream_bytes) is int and 0 <= self.stream_bytes <= self.arena_bytes,
            "memory.stream_bytes",
            self.stream_bytes,
            f"an int in [0, memory.arena_bytes={self.arena_bytes}]",
        )
        _require(
            type(self.expert_bytes) is int and 0 <= self.expert_bytes <= self.stream_bytes,
            "memory.expert_bytes",
            self.expert_bytes,
            f"an int in [0, memory.stream_bytes={self.stream_bytes}]",
        )
        _require(isinstance(self.role_bytes, dict), "memory.role_bytes", self.role_bytes, "a dict of role -> bytes")
        for role, n in self.role_bytes.items():
            _require(type(n) is int and n >= 0, f"memory.role_bytes[{role!r}]", n, "an int >= 0")
        _require(
            isinstance(self.sample_s, (int, float)) and self.sample_s >= 0, "memory.sample_s", self.sample_s, ">= 0"
        )


@dataclass(frozen=True)
class PipelineConfig:
    """The streamed target (scheduler/generation/streaming.py)."""

    layer_bytes: int = 1 * MiB  # one streaming slot: the largest group streamed (scheduler/generation/memplan.py)

    def __post_init__(self):
        _positive("pipeline", self, "layer_bytes")
        _require(type(self.layer_bytes) is int, "pipeline.layer_bytes", self.layer_bytes, "an int")


def default_trace_dir() -> Path:
    """traces/ in the working directory if there is one (a checkout), else $CADENCE_HOME/traces: never
    the package's own folder (site-packages, in a wheel install)."""
    here = Path.cwd() / "traces"
    if here.is_dir():
        return here
    from common import paths

    return paths.home() / "traces"


@dataclass(frozen=True)
class TraceConfig:
    enabled: bool = True
    dir: str | None = None  # default: traces/ at the repository root
    max_events: int = 1_000_000  # beyond this, spans are counted and dropped
    spill_events: int = 0  # > 0: every this many events go to a spill file (bounded memory); 0: all kept in memory

    def __post_init__(self):
        _positive("trace", self, "max_events")
        _require(
            type(self.spill_events) is int and self.spill_events >= 0,
            "trace.spill_events",
            self.spill_events,
            "an int >= 0",
        )

    @property
    def path(self) -> Path:
        return Path(self.dir) if self.dir else default_trace_dir()


@dataclass(frozen=True)
class RuntimeConfig:
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    timeouts: Timeouts = field(default_factory=Timeouts)
    trace: TraceConfig = field(default_factory=TraceConfig)
    # fork the actors from one zygote process that imported their code once (pages shared
    # copy-on-write), instead of starting an interpreter per actor (Linux only)
    fork_actors: bool = True
    preload: tuple = ()  # modules the zygote imports before the first fork (e.g. "actors.verifier")

    def __post_init__(self):
        slot = -(-self.pipeline.layer_bytes // 4096) * 4096  # slots are 4 KiB aligned
        if (
            0 < self.memory.stream_bytes - self.memory.expert_bytes < 2 * slot
        ):  # 0: nothing streams (the budget holds every layer)
            raise ConfigError(
                f"memory.stream_bytes={self.memory.stream_bytes} holds fewer than two streaming slots of "
                f"pipeline.layer_bytes={slot}; raise memory.stream_bytes or lower pipeline.layer_bytes"
            )
