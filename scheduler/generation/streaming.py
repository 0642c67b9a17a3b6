"""A streamed target: the loader fills arena slots ahead of the verifier, which consumes them.

Streamed groups are needed in one fixed order every forward (layers, then the head), so the
loader simply works through that cycle ahead of the verifier, as far as free slots allow
(`prefetch`, the pipelined modes: the next forward's first layers load while the draft drafts)
or only on demand (`std`). A slot goes back to the pool when the verifier's layer op replies.
The trace's "loader slots" counter follows the bytes of slots held against the bound.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from common.errors import CadenceError
from scheduler.events import DeadEvent, ErrorEvent, ReplyEvent
from scheduler.errors import ActorDead, ActorError, RequestTimeout
from scheduler.runtime import Runtime


@dataclass
class IOStats:
    loads: int = 0
    bytes: int = 0
    seconds: float = 0.0  # loader-side read time, summed
    wait_s: float = 0.0  # time the verifier stood waiting for a layer
    direct: bool = True

    def as_dict(self) -> dict:
        return {
            "loads": self.loads,
            "bytes_read": self.bytes,
            "read_s": round(self.seconds, 4),
            "io_wait_s": round(self.wait_s, 4),
            "read_gbps": round(self.bytes / self.seconds / 1e9, 3) if self.seconds else 0.0,
            "direct_io": self.direct,
        }


def raise_fault(ev):
    """An actor's death, or a message it could not read, ends the run with its reason."""
    if isinstance(ev, DeadEvent):
        raise ActorDead(ev.role, ev.reason)
    if isinstance(ev, ErrorEvent):
        raise CadenceError(f"the {ev.role} actor could not read a message: {ev.message}")


def settle_loads(s: Runtime, waiting, on_events, timeout_s: float = 30.0):
    """At the end of a run (also after a failure): poll while `waiting()` and the loader still owes replies,
    so that nothing more is written into slots about to be freed. `pending`: the loader has answered
    everything asked of it (a reply taken by a poll an interrupt cut short is answered all the same)."""
    deadline = time.monotonic() + timeout_s
    loader = s.actors.get("loader")
    while waiting() and loader is not None and loader.alive and s.pending("loader") and time.monotonic() < deadline:
        try:
            on_events(s.poll(0.05))
        except CadenceError:
            break  # the loader died or failed meanwhile: nothing more will come back


@dataclass
class Streamer:
    s: Runtime
    streamed: list[str]  # group names in the order a forward needs them
    sizes: dict[str, int]
    prefetch: bool
    stats: IOStats = field(default_factory=IOStats)  # since the last generation's figures were taken
    total: IOStats = field(default_factory=IOStats)  # the whole run's reads (engine/costs.py `refresh_disk`)

    def __post_init__(self):
        self.next = 0  # index in `streamed` of the next group to load
        self.inflight: dict[int, tuple[str, object]] = {}  # req_id -> (group, slot)
        self.ready: dict[str, object] = {}  # group -> slot holding it
        self.queue: list[str] = []  # groups loading or loaded, in cycle order

    def _issue(self, group: str) -> bool:
        slot = self.s.stream_slots.try_alloc(self.sizes[group])
        if slot is None:
            return False
        rid = self.s.send("loader", "load", {"group": group}, {"slot": self.s.slot_desc(slot)})
        self.inflight[rid] = (group, slot)
        self.queue.append(group)
        self._count()
        return True

    def _count(self):
        if self.s.tracer.enabled:
            slots = self.s.stream_slots
            self.s.tracer.counter("loader slots", {"used": slots.used_bytes, "bound": slots.capacity})

    def refill(self):
        """Keep loading ahead along the cycle while slots are free (pipelined modes)."""
        if not self.prefetch or not self.streamed:
            return
        while len(self.queue) < len(self.streamed) and self._issue(self.streamed[self.next]):
            self.next = (self.next + 1) % len(self.streamed)

    def on_events(self, events):
        for ev in events:
            if isinstance(ev, ReplyEvent) and ev.reply.req_id in self.inflight:
                group, slot = self.inflight.pop(ev.reply.req_id)
                if not ev.reply.ok:
                    raise ActorError("loader", "load", ev.reply.req_id, ev.reply.error)
                r = ev.reply.value  # Loaded
                for st in (self.stats, self.total):
                    st.loads += 1
                    st.bytes += r.bytes
                    st.seconds += r.seconds
                    st.direct = st.direct and r.direct
                self.ready[group] = slot
            else:
                raise_fault(ev)
            # any other reply belongs to a request nobody waits for any more: dropped

    def take(self, group: str):
        """The slot holding `group`, waiting for its load (issued now if nobody asked for it yet)."""
        if group not in self.queue:
            if self.queue:  # the cycle went out of step (a job ended early): drop what was prefetched
                raise CadenceError(f"streaming order broken: {group} needed but {self.queue[0]} is next")
            self.next = self.streamed.index(group)
            while not self._issue(group):
                self.on_events(self.s.poll(0.05))
            self.next = (self.next + 1) % len(self.streamed)
        t = time.perf_counter()
        limit = self.s.config.timeouts.request_s
        deadline = time.monotonic() + limit
        while group not in self.ready:
            if time.monotonic() > deadline:
                rid = next((r for r, (g, _) in self.inflight.items() if g == group), 0)
                raise RequestTimeout("loader", "load", rid, limit)
            self.on_events(self.s.poll(0.05))
        self.stats.wait_s += time.perf_counter() - t
        return self.ready[group]

    def done_with(self, group: str):
        slot = self.ready.pop(group)
        assert self.queue[0] == group, (self.queue, group)
        self.queue.pop(0)
        self.s.stream_slots.free(slot)
        self._count()
        self.refill()

    def feed(self, group: str):
        """Hand the verifier the streamed group it waits for; its reply (what it waits for next, or the
        job's result)."""
        slot = self.take(group)
        r = self.s.call("verifier", "layer", {"group": group}, {"slot": self.s.slot_desc(slot)}).value
        self.done_with(group)
        self.on_events(self.s.poll(0))
        return r

    def drain(self, timeout_s: float = 30.0):
        """Wait for loads still in flight and give every slot back (end of a run, also after a failure)."""
        settle_loads(self.s, lambda: bool(self.inflight), self.on_events, timeout_s)
        for _, slot in self.inflight.values():  # a dead loader's leases were released by the scheduler
            self.s.stream_slots.free(slot)
        self.inflight.clear()
        for g in list(self.ready):
            self.s.stream_slots.free(self.ready.pop(g))
        self.queue.clear()
        self._count()
