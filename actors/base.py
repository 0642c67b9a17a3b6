"""The one shape every actor has: heavy setup in `__init__`, one `run()` loop, one process entry.

An actor is a class with a `role` and handlers named `op_<name>`: a request for op "cycle" runs
`op_cycle` (`handle` below) with the request's arguments as keyword arguments, checked against the
handler's signature as they arrive (actors/calls.py: the one typed path across the boundary; a parameter
named `tensors` takes the request's tensor map). A handler returns a result (a reply dataclass of
actors/calls.py, or a dict), `(result, tensors)`, or None; tensors go back as arena descriptors (or
inline when tiny); work the reply need not wait for goes in `after_reply`, run once the reply has gone
(the draft drafting ahead while the target verifies its tree). An exception in a handler fails that request
only (the caller gets the error text) and the actor keeps serving; `ActorFatal` ends the actor with a DEAD
frame instead.

Process life, driven by `actor_main` (run as `python -m actors '<json spec>'`):
  import the class -> HELLO -> wait INIT -> attach arenas -> `cls(init, ctx)` -> READY -> run()
  -> on STOP / SIGTERM: flush the trace and exit (SIGINT is the scheduler's to handle); on a crash: DEAD(reason) and exit.
"""

from __future__ import annotations

import importlib
import logging
import os
import re
import signal
import sys
import time
from dataclasses import dataclass
from typing import Callable

import zmq

from actors import wire
from actors.lifeline import StopFlag, die_with_parent, install_signal_flags
from actors.calls import is_reply, reply_wire, signature
from actors.tracing import Tracer
from common.heap import trim_heap
from common.procname import set_process_name
from shm.arena import Arena
from shm.desc import InlineTensor, TensorDesc

POLL_MS = 100  # an idle loop checks its stop flag, heartbeat and trace this often
TRACE_FLUSH_S = 0.5
TRACE_BATCH_MAX = 512
LINGER_MS = 1000  # a last DEAD or trace batch still leaves after close
_OP = re.compile(r"[a-z][a-z0-9_]*\Z")
_LOG_FIRST_BAD = 10  # bad frames logged one by one before the log goes quiet


class ActorFatal(Exception):
    """Raise from a handler when the actor cannot go on; the scheduler hears `gave up: <message>`."""


@dataclass
class ActorContext:
    """What the process gives an actor: its socket, arenas, tracer and stop flag."""

    role: str
    sock: zmq.Socket
    arenas: dict[str, Arena]
    trace: Tracer
    stop: StopFlag
    heartbeat_s: float
    log: logging.Logger

    def send(self, msg: wire.Msg) -> None:
        wire.send(self.sock, wire.encode(msg))


class Actor:
    role = "actor"

    def __init__(self, init: dict, ctx: ActorContext):
        self.init = init
        self.ctx = ctx
        self.trace = ctx.trace
        self.arenas = ctx.arenas
        self.log = ctx.log
        self._ops = {name: getattr(self, "op_" + name) for name in self.ops()}
        self._signatures = {name: signature(getattr(type(self), "op_" + name), name) for name in self._ops}
        self._bad_frames = 0
        self._errors_received = 0
        self.after_reply: Callable[[], None] | None = None  # set by a handler: run once its reply has gone

    @classmethod
    def ops(cls) -> list[str]:
        return sorted(n[3:] for n in dir(cls) if n.startswith("op_") and _OP.match(n[3:]))

    @property
    def arena(self) -> Arena:
        """The run's main arena (the first one attached)."""
        return next(iter(self.arenas.values()))

    # -- built-in ops ---------------------------------------------------------------------

    def op_ping(self, tensors: dict, **args):
        """Echo: liveness and the control round-trip benchmark."""
        return args, tensors

    def op_stats(self):
        return {
            "pid": os.getpid(),
            "role": self.role,
            "bad_frames": self._bad_frames,
            "errors_received": self._errors_received,
        }

    # -- tensors (torch is imported only by actors that use these) ------------------------

    def tensor(self, value: TensorDesc | InlineTensor):
        """A wire tensor as a torch tensor; a descriptor maps the arena with no copy."""
        from shm import tensors

        return tensors.as_tensor(self.arenas, value)

    def put(self, at, tensor) -> TensorDesc:
        """Copy a torch tensor into a slot of the main arena that the scheduler gave us."""
        from shm import tensors

        return tensors.put(self.arena, at, tensor)

    def beat(self) -> None:
        """Say "alive" from inside a long op (between layers, say), so a step may outlast
        timeouts.heartbeat_s without counting as hung. Main thread only, like every send."""
        self.ctx.send(wire.Heartbeat(time.monotonic_ns()))

    def interrupted(self) -> bool:
        """A message is waiting: a long op that may stop early (drafting ahead) should end now."""
        return bool(self.ctx.sock.poll(0, zmq.POLLIN))

    def close(self) -> None:
        """Release what `__init__` took (files, threads). Called once the loop has ended."""

    # -- the loop ---------------------------------------------------------------------------

    def handle(self, req: wire.Request) -> wire.Reply:
        fn = self._ops.get(req.op)
        if fn is None:
            return wire.Reply(
                req.req_id,
                False,
                {},
                {},
                f"the {self.role} actor has no op {req.op!r}; it serves {', '.join(self._ops)}",
            )
        with self.trace.span(req.op, cat=self.role, args={"req": req.req_id}, flow_in=req.flow_id):
            try:
                out = fn(**self._signatures[req.op].bind(req.args, req.tensors))
                result, tensors = out if isinstance(out, tuple) else (out or {}, {})
                if is_reply(result):
                    result = reply_wire(result)
                if not isinstance(result, dict) or not isinstance(tensors, dict):
                    raise TypeError(
                        f"op {req.op!r} returned {type(result).__name__}, {type(tensors).__name__}; "
                        f"return a result dict or reply (actors/calls.py), or (result, tensors dict)"
                    )
                return wire.Reply(
                    req.req_id, True, result, {k: _wire_tensor(req.op, k, v) for k, v in tensors.items()}, None
                )
            except ActorFatal:
                raise
            except Exception as e:
                self.log.warning("op %s (request %d) failed: %s: %s", req.op, req.req_id, type(e).__name__, e)
                self.after_reply = None
                return wire.Reply(req.req_id, False, {}, {}, f"{type(e).__name__}: {e}")

    def run(self) -> None:
        ctx = self.ctx
        next_beat = time.monotonic() + ctx.heartbeat_s
        next_flush = time.monotonic() + TRACE_FLUSH_S
        while not ctx.stop:
            try:
                frames = wire.recv(ctx.sock)
            except zmq.Again:
                frames = None
            if frames is not None:
                self._on_frames(frames)
            now = time.monotonic()
            if now >= next_beat:
                ctx.send(wire.Heartbeat(time.monotonic_ns()))
                next_beat = now + ctx.heartbeat_s
            if self.trace.events and (now >= next_flush or len(self.trace.events) >= TRACE_BATCH_MAX):
                self.flush_trace()
                next_flush = now + TRACE_FLUSH_S
        self.flush_trace()

    def flush_trace(self) -> None:
        events = self.trace.drain()
        if events:
            self.ctx.send(wire.TraceBatch(os.getpid(), events))

    def _on_frames(self, frames: list) -> None:
        try:
            msg = wire.decode(frames)
        except wire.WireError as e:
            return self._bad_frame(str(e), None)
        if isinstance(msg, wire.Request):
            reply = self.handle(msg)
            try:
                frames = wire.encode(reply)
            except wire.WireError as e:
                frames = wire.encode(
                    wire.Reply(
                        msg.req_id, False, {}, {}, f"op {msg.op!r} returned something the wire cannot carry: {e}"
                    )
                )
            wire.send(self.ctx.sock, frames)
            then, self.after_reply = self.after_reply, None
            if then is not None:  # work the reply need not wait for (drafting ahead), until a message arrives
                then()
        elif isinstance(msg, wire.Stop):
            self.ctx.stop.requested = True
        elif isinstance(msg, wire.Error):
            self._errors_received += 1  # never answer an error with an error
            if self._errors_received <= _LOG_FIRST_BAD:
                self.log.warning("the scheduler could not read a frame of ours: %s", msg.message)
        else:
            self._bad_frame(f"unexpected {type(msg).__name__} message to a running actor", None)

    def _bad_frame(self, message: str, req_id: int | None) -> None:
        self._bad_frames += 1
        n = self._bad_frames
        if n <= _LOG_FIRST_BAD or n % 1000 == 0:
            self.log.warning("bad frame #%d answered with an error: %s", n, message)
        self.ctx.send(wire.Error(req_id, message))


def _wire_tensor(op: str, name: str, value):
    if isinstance(value, (TensorDesc, InlineTensor)):
        return value
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        from shm import tensors

        try:
            return tensors.to_inline(value)
        except ValueError:
            raise ValueError(
                f"op {op!r} returned tensor {name!r} of {value.numel() * value.element_size()} bytes; "
                f"put it into an arena slot (self.put) and return the descriptor"
            ) from None
    raise ValueError(
        f"op {op!r} returned {type(value).__name__} for tensor {name!r}; return torch tensors or descriptors"
    )


def load_class(path: str) -> type:
    """'package.module:Class' -> the Actor subclass."""
    module, _, qualname = path.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not (isinstance(obj, type) and issubclass(obj, Actor)):
        raise TypeError(f"{path} is not an Actor subclass")
    return obj


def _logger(role: str) -> logging.Logger:
    logging.basicConfig(
        stream=sys.stderr, level=logging.INFO, format=f"cadence {role}[%(process)d] %(levelname)s: %(message)s"
    )
    return logging.getLogger(f"cadence.actor.{role}")


def _wait_init(sock: zmq.Socket, flag: StopFlag, deadline: float, log: logging.Logger) -> wire.Init | None:
    while not flag and time.monotonic() < deadline:
        try:
            frames = wire.recv(sock)
        except zmq.Again:
            continue
        try:
            msg = wire.decode(frames)
        except wire.WireError as e:
            wire.send(sock, wire.encode(wire.Error(None, str(e))))
            continue
        if isinstance(msg, wire.Init):
            return msg
        if isinstance(msg, wire.Stop):
            return None
        wire.send(sock, wire.encode(wire.Error(None, f"expected INIT, got {type(msg).__name__}")))
    if not flag:
        log.error("no INIT from the scheduler; exiting")
    return None


def actor_main(spec: dict) -> int:
    """Process entry for every role. `spec`: role, cls, endpoint, parent_pid, init_wait_s."""
    role = spec["role"]
    set_process_name(f"cad-{role}")
    die_with_parent(spec["parent_pid"], role)
    flag = StopFlag()
    install_signal_flags(flag)
    log = _logger(role)
    zctx = zmq.Context()
    sock = zctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, role.encode())
    sock.setsockopt(zmq.LINGER, LINGER_MS)
    sock.setsockopt(zmq.RCVTIMEO, POLL_MS)
    sock.connect(spec["endpoint"])

    def say(msg: wire.Msg) -> None:
        wire.send(sock, wire.encode(msg))

    actor = None
    try:
        try:
            cls = load_class(spec["cls"])
        except Exception as e:
            say(wire.Dead(role, f"could not load class {spec['cls']}: {type(e).__name__}: {e}"))
            return 1
        say(wire.Hello(role, os.getpid()))
        init = _wait_init(sock, flag, time.monotonic() + spec["init_wait_s"], log)
        if init is None:
            return 0 if flag else 1
        ctx = ActorContext(role, sock, {}, Tracer(init.trace), flag, init.heartbeat_s, log)
        try:
            ctx.arenas.update((name, Arena.attach(name)) for name in init.arenas)
            actor = cls(init.init, ctx)
            trim_heap()  # what loading freed is not the actor's to keep under a budget
        except Exception as e:
            say(wire.Dead(role, f"failed during setup: {type(e).__name__}: {e}"))
            return 1
        say(wire.Ready(role, cls.__name__, cls.ops()))
        try:
            actor.run()
        except ActorFatal as e:
            actor.flush_trace()
            say(wire.Dead(role, f"gave up: {e}"))
            return 1
        except Exception as e:
            log.exception("the run loop crashed")
            say(wire.Dead(role, f"crashed: {type(e).__name__}: {e}"))
            return 1
        # the last word, after the last trace batch on the same socket: the scheduler, which reads them in
        # order, knows that it has everything once this arrives
        how = "when asked" if flag.signum is None else f"on {signal.Signals(flag.signum).name}"
        say(wire.Dead(role, f"stopped {how}"))
        return 0
    finally:
        if actor is not None:
            actor.close()
        sock.close()
        zctx.term()
