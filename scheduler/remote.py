"""An actor's ops called by name, as methods: the scheduler's side of the one typed path across the process
boundary (actors/calls.py). The arguments travel as a msgpack map (a dataclass as the map of its fields), the
tensors as arena descriptors; the actor checks them against its handler's signature and answers with a reply
dataclass or a map.

    draft = Remote(sched, "draft")
    drafted = draft.cycle(cycles=[{"budget": 4}])              # the reply's value
    reply = draft.call("cycle", None, cycles=[{"budget": 4}])  # the whole Reply: its tensors and request id too
    req = Remote(sched, "loader").send("load", {"slot": desc}, group="layer.3")  # queued; its reply taken later
"""

from __future__ import annotations

from actors import wire
from actors.calls import wire_args


class Remote:
    def __init__(self, sched, role: str):
        self.sched, self.role = sched, role

    def call(self, op: str, tensors: dict | None = None, timeout: float | None = None, **args) -> wire.Reply:
        """Op `op` with `args`, waited for: its Reply (ActorError if it failed, ActorDead, RequestTimeout)."""
        return self.sched.call(self.role, op, wire_args(args), tensors, timeout)

    def send(self, op: str, tensors: dict | None = None, **args) -> int:
        """Op `op` with `args`, queued: its request id."""
        return self.sched.send(self.role, op, wire_args(args), tensors)

    def __getattr__(self, op: str):
        if op.startswith("_"):
            raise AttributeError(op)
        return lambda tensors=None, **args: self.call(op, tensors, **args).value
