"""Tensors in requests, scheduler side: descriptors, leases, and one-copy puts into the arena.

A mixin of `Runtime`: it uses `self.arena`, `self.arenas`, `self.slots` (exchange slots) and
`self.stream_slots` (loader slots). torch is imported only when a torch tensor shows up.
"""

from __future__ import annotations

from common.errors import CadenceError
from shm.desc import InlineTensor, TensorDesc
from shm.slots import Slot


class TensorExchange:
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

    def _wire_tensors(self, role: str, tensors: dict, lease: bool) -> tuple[dict, list]:
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
