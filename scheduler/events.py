"""What `Runtime.poll` returns, and the bookkeeping of a request in flight."""

from __future__ import annotations

from dataclasses import dataclass

from actors import wire
from scheduler.errors import ActorDead


@dataclass(frozen=True)
class ReplyEvent:
    role: str
    op: str
    reply: wire.Reply


@dataclass(frozen=True)
class DeadEvent:
    role: str
    reason: str

    def error(self) -> ActorDead:
        return ActorDead(self.role, self.reason)


@dataclass(frozen=True)
class ErrorEvent:
    """An actor could not read a frame of ours (or got one it did not expect)."""

    role: str
    message: str


@dataclass(frozen=True)
class ActorStatus:
    """One actor as the scheduler sees it now (`Runtime.actor_status`): what the monitor shows."""

    role: str
    pid: int
    state: str  # starting | initializing | ready | stopping | dead
    op: str | None  # its oldest request awaiting a reply: what it works on now (None: idle)
    op_since: float | None  # time.monotonic() when that request was sent
    queued: int  # requests sent to it and not yet answered


@dataclass
class Pending:
    role: str
    op: str
    leases: list  # (allocator, slot) pairs released when the reply comes
    abandoned: bool = False  # the caller gave up waiting; a late reply only releases the leases
    sent: float = 0.0  # time.monotonic() of the send
