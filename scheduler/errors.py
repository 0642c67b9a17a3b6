"""What the scheduler raises to its caller. Each is one sentence that names the role."""

from __future__ import annotations

from common.errors import CadenceError


class ActorDead(CadenceError):
    """An actor is gone (crashed, killed, hung, or never started). `reason` completes "the <role> actor ..."."""

    def __init__(self, role: str, reason: str):
        self.role = role
        self.reason = reason
        super().__init__(f"the {role} actor {reason}")


class ActorError(CadenceError):
    """An actor answered a request with an error; the actor itself is still serving."""

    def __init__(self, role: str, op: str, req_id: int, error: str):
        self.role, self.op, self.req_id, self.error = role, op, req_id, error
        super().__init__(f"the {role} actor failed {op!r} (request {req_id}): {error}")


class RequestTimeout(CadenceError):
    """No reply in time; the actor may still be working, and its late reply is dropped."""

    def __init__(self, role: str, op: str, req_id: int, timeout_s: float, setting: str = "timeouts.request_s"):
        self.role, self.op, self.req_id = role, op, req_id
        super().__init__(
            f"the {role} actor did not answer {op!r} (request {req_id}) within {timeout_s:g} s (raise {setting})"
        )
