"""The I/O loader: reads weight-store groups (`embed`, `layer.<i>`, `head`) into arena slots.

The scheduler owns the slots: it allocates one of the group's size from `stream_slots`, sends
`load` with the slot's descriptor (which leases the slot to the loader until the reply), hands
the filled slot to its consumer, then frees it. The loader reads with direct I/O from a pool of
threads (`shm.dio.DirectReader`), heartbeating while it waits, and writes nowhere but the slot.
Loads queued on its socket are served in order, each reply sent as soon as its read is done.

init: store_dir (required), threads (4), chunk_bytes (4 MiB), direct (true), and stream_bytes
(optional: the loader refuses a slot reaching past that many bytes of the arena, the memory bound).
"""

from __future__ import annotations

from actors.base import Actor
from actors.calls import GroupSizes, Loaded, record
from actors.starts import LoaderStart
from formats.store import WeightStore
from shm.desc import TensorDesc
from shm.dio import DEFAULT_CHUNK, DirectReader


class LoaderActor(Actor):
    role = "loader"

    def __init__(self, init: dict, ctx):
        super().__init__(init, ctx)
        start = record(LoaderStart, init, "the loader's start")
        self.store = WeightStore(start.store_dir)
        self.region = start.stream_bytes
        warnings = []
        self.reader = DirectReader(
            self.store.path,
            threads=start.threads,
            chunk_bytes=start.chunk_bytes or DEFAULT_CHUNK,
            direct=start.direct,
            warn=warnings.append,
        )
        for w in warnings:  # once per run: the reader warns once, at open
            self.log.warning("%s", w)
            self.trace.instant("direct I/O fallback", cat="load", args={"reason": w})
        self.loads = self.bytes = self.max_end = 0
        self.seconds = 0.0

    def op_groups(self):
        """The store's groups in file order: name -> bytes (what a slot for it must hold)."""
        return GroupSizes(self.store.group_bytes(), self.store.manifest["file_bytes"])

    def op_load(self, group: str, tensors: dict):
        """Read `group` into the arena slot `tensors["slot"]`."""
        name = group
        group = self.store.groups.get(name)
        if group is None:
            have = list(self.store.groups)
            raise ValueError(
                f"the weight store {self.store.dir} has no group {name!r} (it has {have[0]} ... {have[-1]})"
            )
        desc = tensors.get("slot")
        if not isinstance(desc, TensorDesc):
            raise ValueError("load needs tensors['slot']: the descriptor of the arena slot to fill")
        room = desc.span_bytes if desc.strides == (1,) and desc.dtype == "uint8" else 0
        if group.nbytes > room:
            raise ValueError(
                f"the slot at offset {desc.offset} ({room} bytes of contiguous uint8) cannot hold "
                f"{name} ({group.nbytes} bytes); allocate the slot with the group's size"
            )
        end = desc.offset + group.nbytes
        if self.region is not None and end > self.region:
            raise ValueError(
                f"loading {name} into bytes [{desc.offset}, {end}) would write past the loader's "
                f"{self.region}-byte region of the arena: the memory bound would be broken"
            )
        arena = self.arenas[desc.segment]
        span = {"bytes": group.nbytes}
        self.trace.counter("loader bytes in flight", {"bytes": group.nbytes})
        try:
            with self.trace.span(f"load:{name}", cat="load", args=span):
                st = self.reader.read_into(
                    group.offset, group.nbytes, arena.buf, desc.offset, beat=self.beat, beat_s=self.ctx.heartbeat_s
                )
                span.update(gbps=round(st.gbps, 3), direct=st.direct)
        finally:
            self.trace.counter("loader bytes in flight", {"bytes": 0})
        self.loads += 1
        self.bytes += st.bytes
        self.seconds += st.seconds
        self.max_end = max(self.max_end, end)
        return Loaded(name, st.bytes, st.seconds, st.gbps, st.direct)

    def op_stats(self):
        return {
            **super().op_stats(),
            "loads": self.loads,
            "bytes": self.bytes,
            "seconds": self.seconds,
            "gbps": self.bytes / self.seconds / 1e9 if self.seconds else 0.0,
            "direct": self.reader.direct,
            "fallback_reason": self.reader.fallback_reason,
            "threads": self.reader.threads,
            "chunk_bytes": self.reader.chunk_bytes,
            "max_end": self.max_end,
            "region": self.region,
        }

    def close(self) -> None:
        self.reader.close()
