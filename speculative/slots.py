"""The target side of a batch of generations in this process (speculative/batch.py), and the slots' verifiers and
KV arena the verifier actor keeps too (actors/verifier.py): a verifier per slot, each slot's cache a range of one
arena (speculative/kvpool.py says where), and the prompt cache (speculative/prefixes.py) that keeps what a new
cache overwrites."""

from __future__ import annotations

import torch

from models.kvcache import KVCache
from models.transformer import Transformer
from models.requests import drive
from speculative.prefixes import PrefixCache
from speculative.sides import Start, Step, Verify
from speculative.tree import TokenTree, Verdict
from speculative.verify import Prefill, Verifier, many_steps


class LocalBatch:
    """The target side of a batch of generations (speculative/batch.py) with the model in this process: a
    verifier per slot, every slot's step or verification of a cycle in one forward."""

    streamed = False
    io_wait = None

    def __init__(self, model: Transformer, prefixes: PrefixCache | None = None):
        self.model = model
        self.slots = Slots(model, prefixes)

    def answer(self, calls: list) -> list:
        """Each (slot, `Call`) answered as `LocalTarget` would answer it alone: the prefills one by one, then every
        plain step and verification in one forward."""
        jobs = []
        for slot, call in calls:
            if isinstance(call, Start):
                v = self.slots.begin(slot, call.prompt_ids, call.capacity, call.sampling, call.reuse, call.placed)
                jobs.append((v, Prefill(call.prompt_ids, call.capacity)))
            else:
                jobs.append(_job(self.slots.verifiers[slot], call))
        done = drive(many_steps(jobs), self.model.weights) if jobs else []
        return [
            (None if r is None else (r, v.reused)) if isinstance(w, Prefill) else reply(r)
            for (v, w), r in zip(jobs, done)
        ]

    def release(self, slot: int) -> None:
        """A generation cancelled: its slot's cache goes."""
        self.slots.verifiers.pop(slot, None)

    def take_stats(self, slot: int) -> dict:
        v = self.slots.verifiers.get(slot)
        return v.take_logprobs() if v is not None and v.sampling.logprobs >= 0 else {}


class Slots:
    """A batch's verifiers by slot, their caches in one arena (speculative/kvpool.py says where each goes), and the
    prompt cache that keeps what a new cache overwrites: the same in this process and in the verifier actor."""

    def __init__(self, model: Transformer, prefixes: PrefixCache | None = None):
        self.model, self.prefixes = model, prefixes
        self.verifiers: dict[int, Verifier] = {}
        self.pool = Arena(model)

    def begin(self, slot: int, prompt_ids, capacity: int, sampling, reuse: bool, placed) -> Verifier:
        """Slot's verifier for a prefill call: the one whose prompt is under way (its next chunk), else a new
        prompt's, in the range `placed` (a `Placed`, or its list over the wire; None: a cache of its own). The slot's
        last cache is continued where the slot kept its range (`reuse`); the idle caches the new range overwrites,
        and the slot's last one where it is not continued, go to the prompt cache first."""
        v = self.verifiers.get(slot)
        if v is not None and v.prefilling and not v.cache.whole:  # (`whole`: a chunk's forward failed half-way)
            return v
        kept = reuse and (placed is None or bool(placed[3]))
        storage = self.pool.view(placed, capacity)
        for s, old in list(self.verifiers.items()):
            if s == slot and kept:
                continue
            if s == slot or (storage is not None and old.cache is not None and _overlap(old.cache, storage)):
                if reuse and self.prefixes is not None:
                    self.prefixes.keep(old.tokens, old.cache)
                del self.verifiers[s]
        if storage is not None and not (placed[3] and kept):
            storage.zero_()  # a new cache starts as a cache of its own would, zeroed
        v = Verifier(self.model, sampling, self.verifiers.get(slot), self.prefixes if reuse else None)
        v.begin_prompt(list(prompt_ids), capacity, storage)
        self.verifiers[slot] = v
        return v


def _overlap(cache: KVCache, storage: torch.Tensor) -> bool:
    """Whether `cache` lives in memory `storage` covers (a range of the same arena)."""
    a0, b0 = cache.k.data_ptr(), storage.data_ptr()
    a1, b1 = (
        a0 + KVCache.numel(cache.args, cache.capacity, cache.dtype) * 4,
        b0 + storage.numel() * storage.element_size(),
    )
    same = cache.k.untyped_storage().data_ptr() == storage.untyped_storage().data_ptr()
    return same and a0 < b1 and b0 < a1


class Arena:
    """The memory of a batch's KV pool (speculative/kvpool.py decides where each cache goes): one array, made at the
    first start placed in it, each slot's cache a view of its range (its pages touched as a cache takes them)."""

    def __init__(self, model: Transformer):
        self.model, self.memory = model, None

    def view(self, placed, capacity: int) -> torch.Tensor | None:
        """The storage of a cache of `capacity` rows at `placed` (a `Placed`, or its list over the wire; None: a
        cache of its own), as it is (a new cache zeroes it)."""
        if placed is None:
            return None
        offset, total = int(placed[0]), int(placed[2])
        if self.memory is None or self.memory.numel() != total:
            self.memory = torch.empty(total, dtype=torch.float32, device=self.model.device)
        return self.memory[offset : offset + KVCache.numel(self.model.args, capacity, self.model.kv_dtype)]


def _job(v: Verifier, call: Step | Verify) -> tuple:
    """A plain step or a verification as a `many_steps` job."""
    if isinstance(call, Step):
        return v, call.root
    return v, TokenTree.of(call.proposal.tree)


def reply(r):
    """What a target side answers: a start's (token, reused), a step's token, a verification's (path, next token)."""
    return (r.path, r.next_token) if isinstance(r, Verdict) else r
