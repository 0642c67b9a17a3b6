"""Tensors in requests, scheduler side: the run's shared-memory arena, its slots, descriptors, leases,
and one-copy puts into it.

`TensorExchange` owns the arena and its three parts: the loader's slots (`stream_slots`), the expert
buffer at their end (`expert_slots`), and the exchange slots for the tensors of requests (`slots`).
torch is imported only when a torch tensor shows up.
"""

from __future__ import annotations

from common.errors import CadenceError
from scheduler.runtime_config import MemoryConfig
from shm.arena import ALIGN, Arena
from shm.desc import InlineTensor, TensorDesc
from shm.slots import Slot, SlotAllocator


class TensorExchange:
    def __init__(self, run_id: str, mem: MemoryConfig):
        self.arena = Arena.create(run_id, "main", mem.arena_bytes)
        self.arenas = {self.arena.name: self.arena}
        try:
            stream = mem.stream_bytes // ALIGN * ALIGN
            experts = mem.expert_bytes // ALIGN * ALIGN
            self.stream_slots = SlotAllocator(stream - experts, name="the loader slots", setting="memory.stream_bytes")
            self.expert_slots = SlotAllocator(
                experts, base=stream - experts, name="the expert buffer", setting="memory.expert_bytes"
            )
            self.slots = SlotAllocator(
                self.arena.nbytes - stream,
                base=stream,
                name="the exchange part of the arena",
                setting="memory.arena_bytes",
            )
        except BaseException:
            self.close()
            raise

    @property
    def segments(self) -> list[str]:
        """The shared-memory segments an actor maps (their names)."""
        return list(self.arenas)

    def close(self) -> None:
        """Unmap and unlink the arena: the end of the run."""
        for a in self.arenas.values():
            a.close()
            a.unlink()

    def slot_desc(self, slot: Slot) -> TensorDesc:
        """A raw byte view of a slot: what a producer (the loader) writes into."""
        return TensorDesc(self.arena.name, slot.offset, "uint8", (slot.nbytes,), (1,))

    def put(self, tensor) -> tuple[Slot, TensorDesc]:
        """Copy a torch tensor into a new exchange slot. Free the slot when done with it."""
        from shm import tensors

        slot = self.slots.alloc(max(tensor.numel() * tensor.element_size(), 1))
        return slot, tensors.put(self.arena, slot, tensor)

    def view(self, value):
        from shm import tensors

        return tensors.as_tensor(self.arenas, value)

    def wire_tensors(self, role: str, tensors: dict, lease: bool) -> tuple[dict, list]:
        """A request's tensors as they travel (descriptors, or inline when tiny), and the (allocator, slot)
        leases taken for `role` until its reply: the slots it reads cannot be reused meanwhile."""
        out, leases = {}, []
        for name, value in tensors.items():
            owned = None
            if not isinstance(value, (TensorDesc, InlineTensor)):
                value, owned = self._auto_put(name, value)
            out[name] = value
            if owned is not None:
                # our own copy: leased to the consumer, freed now, reclaimed when the reply comes
                self.slots.lease(owned, role)
                leases.append((self.slots, owned))
                self.slots.free(owned)
            elif lease and isinstance(value, TensorDesc) and value.segment == self.arena.name:
                for alloc in (self.stream_slots, self.slots):
                    slot = alloc.slot_at(value.offset)
                    if slot is not None:
                        alloc.lease(slot, role)
                        leases.append((alloc, slot))
                        break
        return out, leases

    def _auto_put(self, name: str, value) -> tuple:
        """A torch tensor: inline when tiny, else one copy into a new exchange slot."""
        from shm import tensors
        from shm.desc import INLINE_MAX

        if not hasattr(value, "element_size"):
            raise CadenceError(f"tensor {name!r} is a {type(value).__name__}; send torch tensors or descriptors")
        if value.numel() * value.element_size() <= INLINE_MAX:
            return tensors.to_inline(value), None
        slot, desc = self.put(value)
        return desc, slot
