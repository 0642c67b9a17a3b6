"""The expert buffer of a mixture of experts under a memory budget (EdgeMoE §3.3), on the scheduler's side.

The verifier computes a layer's attention and router, then asks for the experts its tokens route
to (for a token tree: the union over its tokens). `serve` answers from the buffer, a region at the
end of the loader's part of the arena: a held expert is a hit; a missing one is read by the loader
(direct I/O, one expert one read) into room made by the eviction policy (expert_policy.py: LRU or
EdgeMoE's score), never evicting the experts of the request at hand. Then it preloads the next
layer's likely experts, one read at a time so that demand reads never queue behind them: from the
path statistics profiled offline (EdgeMoE §3.3.2), or from the next layer's router applied to this
layer's input (the verifier's guess, mixtral-offloading's lookahead). When the next layer's real
router answers, preloads not yet started stop. `eviction="none"` is loading on demand: the buffer
keeps nothing past the layer that used it, and nothing is preloaded (the baseline EdgeMoE beats).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from common.errors import CadenceError
from common.settings import ExpertOptions
from formats.store import expert_group
from scheduler.errors import ActorDead, ActorError, RequestTimeout
from scheduler.events import DeadEvent, ReplyEvent
from scheduler.generation.expert_policy import PathStats, make_eviction
from scheduler.generation.streaming import raise_fault, settle_loads
from scheduler.runtime import Runtime

PRELOAD_INFLIGHT = 1  # preload reads handed to the loader at once: a demand read waits behind at most this many


@dataclass
class ExpertStats:
    hits: int = 0  # held when asked for (or on their way, read by a preload); hits + misses: the experts asked
    # for (a tree's union counts each expert once per layer)
    misses: int = 0
    preloads: int = 0  # reads started by a preload
    preload_hits: int = 0  # of the hits, those a preload brought
    evictions: int = 0
    reads: int = 0
    bytes: int = 0
    read_s: float = 0.0
    wait_s: float = 0.0  # time the verifier stood waiting for experts

    def as_dict(self) -> dict:
        asked = self.hits + self.misses
        return {
            "expert_requests": asked,
            "expert_hits": self.hits,
            "expert_misses": self.misses,
            "expert_hit_rate": round(self.hits / asked, 4) if asked else 0.0,
            "expert_preloads": self.preloads,
            "expert_preload_hits": self.preload_hits,
            "expert_evictions": self.evictions,
            "expert_reads": self.reads,
            "expert_bytes_read": self.bytes,
            "expert_read_s": round(self.read_s, 4),
            "expert_wait_s": round(self.wait_s, 4),
        }


class ExpertCache:
    def __init__(
        self,
        s: Runtime,
        sizes: dict[str, int],
        n_layers: int,
        n_experts: int,
        options: ExpertOptions = ExpertOptions(),
        profile: PathStats | None = None,
    ):
        eviction, preload, preload_k = options.eviction, options.preload, options.preload_k
        if preload == "paths" and profile is None:
            raise CadenceError(
                "--expert-preload paths needs the model's expert path profile; "
                "write it with `launch models profile-experts MODEL`"
            )
        self.s, self.sizes, self.n_layers = s, sizes, n_layers
        self.slots = s.expert_slots
        self.ondemand = eviction == "none"
        self.preload = "none" if self.ondemand else preload
        self.policy = None if self.ondemand else make_eviction(eviction, n_layers, n_experts, profile)
        self.profile, self.preload_k = profile, preload_k
        self.held: dict[tuple[int, int], object] = {}  # (layer, expert) -> its slot
        self.loading: dict[int, tuple[tuple[int, int], object, bool]] = {}  # request -> (key, slot, a preload?)
        self.by_key: dict[tuple[int, int], int] = {}  # key -> its read's request
        self.preloaded: set[tuple[int, int]] = set()  # brought by a preload, not asked for since
        self.queue: list[tuple[int, int]] = []  # preloads not started yet
        self.pinned: set[tuple[int, int]] = set()  # the request at hand: never evicted
        self.last: dict[int, tuple[int, ...]] = {}  # layer -> the experts its last request used
        self.layer = -1  # the layer of the request at hand
        self.failure: ActorError | ActorDead | None = None
        self.on_events = None  # the Streamer's, when layers stream too: it hears what this class's polls take
        self.stats = ExpertStats()
        self.taken = ExpertStats()  # what take_stats handed out, summed: with `stats`, the run's totals
        s.add_listener(self._on_event)

    # -- a request ------------------------------------------------------------------------------

    def serve(self, layer: int, experts: list[int], guess: list[int]) -> dict:
        """The verifier needs `experts` of `layer`: {"e<id>": slot descriptor} once every one is in the buffer."""
        self.queue.clear()  # the real router answered: what was guessed and not started stops here
        keys = [(layer, e) for e in experts]
        self.pinned = set(keys)
        if self.ondemand:  # nothing outlives the layer that used it
            for k in [k for k in self.held if k not in self.pinned]:
                self._evict(k)
        st = self.stats
        missed = []
        for k in keys:
            if k in self.held or k in self.by_key:
                st.hits += 1
                if k in self.preloaded:
                    st.preload_hits += 1
            else:
                st.misses += 1
                missed.append(k[1])
                self._read(k, preload=False)
            self.preloaded.discard(k)
            if self.policy is not None:
                self.policy.use(k)
        # a layer whose union did not fit at once comes in parts: its path is all of them
        self.last[layer] = tuple(sorted({*self.last[layer], *experts})) if layer == self.layer else tuple(experts)
        self.layer = layer
        self._plan_preloads(layer, self.last[layer], guess)
        tracer = self.s.tracer
        if tracer.enabled:  # what the trace shows of the buffer: each request's misses, and the running counts
            tracer.instant(
                f"experts {layer}",
                cat="experts",
                args={
                    "layer": layer,
                    "experts": list(experts),
                    "missed": missed,
                    "preloading": [e for _, e in self.queue],
                },
            )
            tracer.counter("expert buffer", {"held": len(self.held), "hits": st.hits, "misses": st.misses})
        self._wait(keys)
        return {f"e{e}": self.s.slot_desc(self.held[(layer, e)]) for e in experts}

    def _plan_preloads(self, layer: int, experts: list[int], guess: list[int]):
        nxt = (layer + 1) % self.n_layers  # after the last layer: the next token's first
        if self.preload == "router":
            cands = guess
        elif self.preload == "paths":
            prev2 = self.last.get(layer - 1) if layer > 0 else None
            cands = [e for e, _ in self.profile.predict(nxt, experts, prev2, self.preload_k)]
        else:
            return
        self.queue = [(nxt, e) for e in cands if (nxt, e) not in self.held and (nxt, e) not in self.by_key][
            : self.preload_k
        ]
        self._next_preload()

    def _next_preload(self):
        """Start queued preloads while fewer than PRELOAD_INFLIGHT are under way and room can be made."""
        while self.queue and sum(pre for _, _, pre in self.loading.values()) < PRELOAD_INFLIGHT:
            k = self.queue.pop(0)
            if k in self.held or k in self.by_key:
                continue
            if not self._read(k, preload=True):
                self.queue.clear()  # no room without evicting what this request uses
                return
            self.stats.preloads += 1
            self.preloaded.add(k)

    # -- reads and room -------------------------------------------------------------------------

    def _read(self, key: tuple[int, int], preload: bool) -> bool:
        group = expert_group(*key)
        slot = self._room(self.sizes[group], key[0])
        if slot is None:
            if preload:
                return False
            raise CadenceError(
                f"the expert buffer ({self.slots.capacity >> 20} MiB) cannot hold the "
                f"{len(self.pinned)} experts layer {key[0]} needs at once; raise --memory-budget"
            )
        rid = self.s.send("loader", "load", {"group": group}, {"slot": self.s.slot_desc(slot)})
        self.loading[rid] = (key, slot, preload)
        self.by_key[key] = rid
        return True

    def _room(self, nbytes: int, layer: int):
        slot = self.slots.try_alloc(nbytes)
        if slot is not None:
            return slot
        victims = [k for k in self.held if k not in self.pinned]
        for k in victims if self.policy is None else self.policy.order(victims, layer):
            self._evict(k)
            slot = self.slots.try_alloc(nbytes)
            if slot is not None:
                return slot
        return None

    def _evict(self, key: tuple[int, int]):
        self.slots.free(self.held.pop(key))
        self.preloaded.discard(key)
        self.stats.evictions += 1

    def _on_event(self, ev):
        """A listener: it sees the loader's replies whoever polls, and starts the next preload as one ends."""
        if isinstance(ev, ReplyEvent) and ev.reply.req_id in self.loading:
            key, slot, _ = self.loading.pop(ev.reply.req_id)
            del self.by_key[key]
            if not ev.reply.ok:
                self.slots.free(slot)
                self.failure = ActorError("loader", "load", ev.reply.req_id, ev.reply.error)
                return
            r = ev.reply.value  # Loaded
            self.held[key] = slot
            self.stats.reads += 1
            self.stats.bytes += r.bytes
            self.stats.read_s += r.seconds
            self._next_preload()
        elif isinstance(ev, DeadEvent) and ev.role == "loader":
            self.failure = ActorDead(ev.role, ev.reason)

    def _wait(self, keys: list[tuple[int, int]]):
        t = time.perf_counter()
        limit = self.s.config.timeouts.request_s
        deadline = time.monotonic() + limit
        while not all(k in self.held for k in keys):
            if self.failure is not None:
                raise self.failure
            if time.monotonic() > deadline:
                rid = next((self.by_key[k] for k in keys if k in self.by_key), 0)
                raise RequestTimeout("loader", "load", rid, limit)
            self._hear(self.s.poll(0.05))  # the listener takes the loader's replies for experts
        self.stats.wait_s += time.perf_counter() - t

    def take_stats(self) -> dict:
        st, self.stats = self.stats, ExpertStats()
        for k, v in vars(st).items():
            setattr(self.taken, k, getattr(self.taken, k) + v)
        return st.as_dict()

    def totals(self) -> tuple[int, int, int]:
        """(hits, misses, bytes read) since the run began: what the monitor shows."""
        return (
            self.taken.hits + self.stats.hits,
            self.taken.misses + self.stats.misses,
            self.taken.bytes + self.stats.bytes,
        )

    def _hear(self, events):
        """What a poll of this class took: the Streamer's (when layers stream too), else only the faults."""
        if self.on_events is not None:
            self.on_events(events)
        else:
            for ev in events:
                raise_fault(ev)

    def close(self):
        """Give every slot back once the loader has answered what was asked of it (end of a run, also after a failure)."""
        self.queue.clear()
        settle_loads(self.s, lambda: bool(self.loading), self._hear)
        self.s.remove_listener(self._on_event)
        for _, slot, _ in self.loading.values():
            self.slots.free(slot)
        self.loading.clear()
        self.by_key.clear()
        for k in list(self.held):
            self.slots.free(self.held.pop(k))
