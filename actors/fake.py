"""FAKE actors: scripted, seeded stand-ins for the four roles, for the scheduler's integration tests.

They sleep instead of computing (durations drawn from a seeded RNG, scaled by the partition
share they are given) and they move real bytes through the real arena: the fake loader stamps
each slot with its load sequence number and a byte pattern, and the fake verifier and sparse
worker check the whole slot before "using" it, so a slot reused before its consumer released
it fails the request. None of them imports torch.

init keys (all optional): seed, durations {op: [min_s, max_s]}, stream_bytes (loader),
confidence [lo, hi] (draft), accept_p (verifier: chance each tree token is accepted).
"""
from __future__ import annotations

import random
import struct
import time
import zlib

import numpy as np

from actors.base import Actor, ActorFatal
from shm.desc import TensorDesc

_MAGIC = b"CDNCLOAD"
_HEAD = struct.Struct("<8sqq")  # magic, seq, layer


def _bytes(actor: Actor, desc: TensorDesc) -> np.ndarray:
    """The slot's bytes as a numpy view of the arena: no copy."""
    arena = actor.arenas[desc.segment]
    if desc.offset + desc.span_bytes > arena.nbytes:
        raise ValueError(f"descriptor reaches past the end of {arena.name}")
    return np.frombuffer(arena.buf, dtype=np.uint8, count=desc.span_bytes, offset=desc.offset)


def _pattern(seq: int) -> int:
    return (seq * 131 + 7) & 0xFF


def stamp_slot(buf: np.ndarray, seq: int, layer: int) -> None:
    buf[_HEAD.size:] = _pattern(seq)
    buf[:_HEAD.size] = np.frombuffer(_HEAD.pack(_MAGIC, seq, layer), dtype=np.uint8)


def check_slot(buf: np.ndarray, seq: int, layer: int) -> None:
    magic, got_seq, got_layer = _HEAD.unpack(buf[:_HEAD.size].tobytes())
    if magic != _MAGIC or (got_seq, got_layer) != (seq, layer):
        raise ValueError(f"slot for load {seq} (layer {layer}) holds load {got_seq} (layer {got_layer}): "
                         f"it was overwritten before its consumer released it")
    if not (buf[_HEAD.size:] == _pattern(seq)).all():
        raise ValueError(f"slot for load {seq} was partly overwritten before its consumer released it")


class FakeActor(Actor):
    """What every fake shares: the seeded RNG, scripted sleeps, and ops for lifecycle tests."""

    role = "fake"
    DURATIONS: dict = {}  # op -> (min_s, max_s)

    def __init__(self, init: dict, ctx):
        super().__init__(init, ctx)
        self.rng = random.Random(f"{init.get('seed', 0)}:{self.role}")
        self.durations = {**self.DURATIONS, **{k: tuple(v) for k, v in init.get("durations", {}).items()}}

    def work(self, op: str, share: float = 1.0) -> None:
        lo, hi = self.durations.get(op, (0.0, 0.0))
        seconds = self.rng.uniform(lo, hi) * share
        if seconds > 0:
            with self.trace.span("compute", cat=self.role, args={"s": round(seconds, 6)}):
                time.sleep(seconds)

    def op_reseed(self, args, tensors):
        """Restart the RNG as `seed` (benchmarks replay one workload block after block)."""
        self.rng = random.Random(f"{args['seed']}:{self.role}")
        return {}

    def op_sleep(self, args, tensors):
        """Sleep `s` seconds, in `beats` slices with a heartbeat after each (0: silent)."""
        beats = int(args.get("beats", 0))
        for _ in range(max(beats, 1)):
            time.sleep(float(args.get("s", 0.0)) / max(beats, 1))
            if beats:
                self.beat()
        return {"slept": args.get("s", 0.0)}

    def op_fail(self, args, tensors):
        raise ValueError(args.get("message", "scripted failure"))

    def op_give_up(self, args, tensors):
        raise ActorFatal(args.get("message", "scripted fatal error"))

    def op_transform(self, args, tensors):
        """Stress test: check the input's crc, write its bytes reversed into the output slot."""
        src = _bytes(self, tensors["x"])
        if zlib.crc32(src) != args["crc"]:
            raise ValueError(f"input of request {args.get('tag')} changed under us (crc mismatch)")
        time.sleep(self.rng.uniform(0, float(args.get("max_sleep_s", 0.0))))
        dst = _bytes(self, tensors["out"])[: src.size]
        dst[:] = src[::-1]
        if zlib.crc32(src) != args["crc"]:
            raise ValueError(f"input of request {args.get('tag')} changed while we read it")
        return {"crc": zlib.crc32(dst), "n": int(src.size)}


class FakeDraftActor(FakeActor):
    role = "draft"
    DURATIONS = {"draft_step": (0.002, 0.004)}

    def op_draft_step(self, args, tensors):
        self.work("draft_step")
        lo, hi = self.init.get("confidence", (0.6, 1.0))
        return {"conf": self.rng.uniform(lo, hi)}


class FakeLoaderActor(FakeActor):
    """Writes each load into the slot it is given, and nowhere else: the loader's memory bound."""

    role = "loader"
    DURATIONS = {"load": (0.002, 0.005)}

    def __init__(self, init: dict, ctx):
        super().__init__(init, ctx)
        self.region = int(init["stream_bytes"])  # the loader may write [0, region) of the arena
        self.loads = self.bytes_written = self.max_end = 0

    def op_load(self, args, tensors):
        desc = tensors["slot"]
        end = desc.offset + desc.span_bytes
        if end > self.region:
            raise ActorFatal(f"load {args['seq']} was given bytes [{desc.offset}, {end}) outside the loader's "
                             f"{self.region}-byte region: the memory bound would be broken")
        self.work("load")  # "reading the blob"
        stamp_slot(_bytes(self, desc), args["seq"], args["layer"])
        self.loads += 1
        self.bytes_written += desc.span_bytes
        self.max_end = max(self.max_end, end)
        return {"seq": args["seq"], "nbytes": desc.span_bytes}

    def op_stats(self, args, tensors):
        return {**super().op_stats(args, tensors), "loads": self.loads,
                "bytes_written": self.bytes_written, "max_end": self.max_end, "region": self.region}


class FakeVerifierActor(FakeActor):
    role = "verifier"
    DURATIONS = {"verify_layer": (0.002, 0.004)}

    def op_verify_layer(self, args, tensors):
        check_slot(_bytes(self, tensors["slot"]), args["seq"], args["layer"])
        self.work("verify_layer", float(args.get("share", 1.0)))
        if not args.get("last"):
            return {}
        p = float(self.init.get("accept_p", 0.8))
        accepted = 0
        while accepted < args["tree"] and self.rng.random() < p:
            accepted += 1
        return {"accepted": accepted}


class FakeSparseAttnActor(FakeActor):
    role = "sparse"
    DURATIONS = {"sparse_attn": (0.002, 0.004)}

    def op_sparse_attn(self, args, tensors):
        check_slot(_bytes(self, tensors["slot"]), args["seq"], args["layer"])
        self.work("sparse_attn", float(args.get("attn_share", 0.0)) + float(args.get("linear_share", 0.0)))
        return {}


FAKES = {"draft": FakeDraftActor, "verifier": FakeVerifierActor, "sparse": FakeSparseAttnActor, "loader": FakeLoaderActor}
