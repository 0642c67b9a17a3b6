"""FAKE actors, for integration tests: the four roles speaking the real ops, with no model.
(The target and the draft are in target.py beside this module.)

`ActorSession(..., impl=FAKES)` spawns these instead of the real actors, so the scheduler that
`launch run` uses is driven in seconds. They sleep instead of computing and move real bytes through
the real arena:
- the target is a pure function of the text (`target_next`: a hash of the last two tokens), so a
  speculative run must give exactly `target_text`; the fake draft proposes trees whose tokens are
  the target's with probability `accept_p` (seeded);
- the fake loader stamps each slot it fills (magic, load number, group, bytes, then a byte pattern)
  and writes nowhere else; the fake verifier checks the whole stamp before and after "computing" a
  streamed group, and that load numbers only grow, so a slot reused before its release, or a stale
  one, fails the request loudly;
- with the worker, a split job is one `serve` request, and the fake verifier and worker meet step
  by step in the real sync area's words (actors/syncarea.py), with no message per layer.

The fake model is a directory standing in for the weight store (the `store` / `store_dir` every real
actor is given): `fake.json` there (`write_fake_store`) holds the vocabulary, the target's groups in
forward order with their bytes, the seed, and each role's script:
  durations {key: [min_s, max_s]}  seeded sleeps (verifier: "group" per group of a forward, "dense",
                                   "cols"; draft: "build", "ahead" per step; loader: "load";
                                   sparse: "attn", "cols" per step it serves)
  die_at {op: n}                   SIGKILL itself at the n-th request of `op` (before answering)
  fail_at {op: n}                  answer the n-th request of `op` with an error
  hang_at {op: n}                  never answer the n-th request of `op` (heartbeating: not "hung")
  accept_p (draft)                 chance that each drafted token is the target's
None of them imports torch.
"""

from __future__ import annotations

import json
import os
import random
import signal
import struct
import time
import zlib
from collections import deque
from pathlib import Path

import numpy as np

from actors import wire
from actors.base import Actor, ActorFatal
from actors.calls import GroupSizes, Loaded
from models.args import ModelArgs
from actors.syncarea import ABANDONED, END, FORWARD, VERIFIER as VERIFIER_WORD, WORKER as WORKER_WORD, Clock, SyncArea
from shm.desc import TensorDesc

SCRIPT = "fake.json"
_MAGIC = b"CDNCLOAD"
_HEAD = struct.Struct("<8sq32sq")  # magic, load number, group name, bytes
LOG_ENTRIES = 4096  # entries kept in the logs `stats` reports


def target_next(tokens: list[int], vocab: int) -> int:
    """The fake target's greedy choice after `tokens`: a function of the last two."""
    a, b = (tokens[-2] if len(tokens) > 1 else -1), tokens[-1]
    return zlib.crc32(struct.pack("<2q", a, b)) % vocab


def target_text(prompt: list[int], n: int, vocab: int) -> list[int]:
    """What the fake target alone generates: `n` tokens after `prompt`."""
    text = list(prompt)
    for _ in range(n):
        text.append(target_next(text, vocab))
    return text[len(prompt) :]


def fake_args(vocab: int = 64, n_layers: int = 8, context: int = 1 << 20) -> ModelArgs:
    """The fake target's shape: what the sparse worker's arena slots are sized from (the fakes compute nothing)."""
    return ModelArgs(
        arch="llama",
        vocab_size=vocab,
        dim=8,
        n_layers=n_layers,
        n_heads=2,
        n_kv_heads=1,
        ffn_dim=16,
        norm_eps=1e-5,
        rope_base=1e4,
        context_length=context,
        qkv_bias=False,
        tied_embeddings=False,
        head_dim=4,
    )


def write_fake_store(path, groups: dict[str, int], vocab: int = 64, seed: int = 0, **roles) -> str:
    """A fake model in `path`: `groups` name -> bytes in forward order; `roles` role -> script."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / SCRIPT).write_text(json.dumps({"vocab": vocab, "groups": groups, "seed": seed, **roles}))
    return str(path)


def slot_bytes(actor: Actor, desc: TensorDesc, n: int | None = None) -> np.ndarray:
    """The slot's first `n` bytes (all of it by default) as a numpy view of the arena: no copy."""
    arena = actor.arenas[desc.segment]
    n = desc.span_bytes if n is None else n
    if n > desc.span_bytes or desc.offset + n > arena.nbytes:
        raise ValueError(f"{n} bytes at offset {desc.offset} reach past the slot or the end of {arena.name}")
    return np.frombuffer(arena.buf, dtype=np.uint8, count=n, offset=desc.offset)


def _pattern(seq: int) -> int:
    return (seq * 131 + 7) & 0xFF


def stamp_slot(buf: np.ndarray, seq: int, group: str) -> None:
    buf[_HEAD.size :] = _pattern(seq)
    buf[: _HEAD.size] = np.frombuffer(_HEAD.pack(_MAGIC, seq, group.encode(), buf.size), dtype=np.uint8)


def check_slot(buf: np.ndarray, group: str) -> int:
    """The load number of the stamp `group` left in `buf`; ValueError if it is not all there."""
    magic, seq, got, n = _HEAD.unpack(buf[: _HEAD.size].tobytes())
    got = got.rstrip(b"\0").decode(errors="replace")
    if magic != _MAGIC or got != group or n != buf.size:
        raise ValueError(
            f"the slot for {group} holds {got or 'no load'} ({n} bytes, load {seq}): "
            "it was overwritten before its consumer released it, or never loaded"
        )
    if not (buf[_HEAD.size :] == _pattern(seq)).all():
        raise ValueError(f"the slot for {group} (load {seq}) was partly overwritten before its consumer released it")
    return seq


class FakeActor(Actor):
    """What every fake shares: its script (sleeps, deaths, failures, hangs) and ops for lifecycle tests."""

    role = "fake"
    DURATIONS: dict = {}  # key -> (min_s, max_s)

    def __init__(self, init: dict, ctx):
        super().__init__(init, ctx)
        store = init.get("store") or init.get("store_dir")
        self.model = json.loads((Path(store) / SCRIPT).read_text()) if store else {}
        self.vocab = int(self.model.get("vocab", 64))
        self.script = self.model.get(self.role, {})
        self.rng = random.Random(f"{init.get('seed', self.model.get('seed', 0))}:{self.role}")
        self.durations = {**self.DURATIONS, **{k: tuple(v) for k, v in self.script.get("durations", {}).items()}}
        self.calls: dict[str, int] = {}

    def handle(self, req: wire.Request) -> wire.Reply:
        n = self.calls[req.op] = self.calls.get(req.op, 0) + 1
        if self.script.get("die_at", {}).get(req.op) == n:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.script.get("hang_at", {}).get(req.op) == n:
            while not self.ctx.stop:  # beating: only the request's own timeout can tell
                time.sleep(0.05)
                self.beat()
        if self.script.get("fail_at", {}).get(req.op) == n:
            return wire.Reply(
                req.req_id, False, {}, {}, f"ValueError: scripted failure of {req.op} (request {n} of it)"
            )
        return super().handle(req)

    def work(self, key: str, share: float = 1.0, span: str = "compute") -> None:
        lo, hi = self.durations.get(key, (0.0, 0.0))
        seconds = self.rng.uniform(lo, hi) * share
        if seconds > 0:
            with self.trace.span(span, cat=self.role, args={"s": round(seconds, 6)}):
                time.sleep(seconds)

    def op_stats(self):
        return {**super().op_stats(), "calls": dict(self.calls)}

    def op_reseed(self, seed: int):
        """Restart the RNG as `seed` (benchmarks replay one workload block after block)."""
        self.rng = random.Random(f"{seed}:{self.role}")
        return {}

    def op_sleep(self, s: float = 0.0, beats: int = 0):
        """Sleep `s` seconds, in `beats` slices with a heartbeat after each (0: silent)."""
        for _ in range(max(beats, 1)):
            time.sleep(s / max(beats, 1))
            if beats:
                self.beat()
        return {"slept": s}

    def op_fail(self, message: str = "scripted failure"):
        raise ValueError(message)

    def op_give_up(self, message: str = "scripted fatal error"):
        raise ActorFatal(message)

    def op_transform(self, crc: int, tensors: dict, tag=None, max_sleep_s: float = 0.0):
        """Stress test: check the input's crc, write its bytes reversed into the output slot."""
        src = slot_bytes(self, tensors["x"])
        if zlib.crc32(src) != crc:
            raise ValueError(f"input of request {tag} changed under us (crc mismatch)")
        time.sleep(self.rng.uniform(0, max_sleep_s))
        dst = slot_bytes(self, tensors["out"])[: src.size]
        dst[:] = src[::-1]
        if zlib.crc32(src) != crc:
            raise ValueError(f"input of request {tag} changed while we read it")
        return {"crc": zlib.crc32(dst), "n": int(src.size)}


class FakeSync:
    """One split job in the real sync area (actors/syncarea.py), as the fakes meet there: its own job id and
    the last step reached; the verifier ends the job with the header's END and one more step. Python's
    stores need no fence between two processes on one x86 machine: the fakes stay torch-free."""

    def __init__(self, actor: Actor, desc: TensorDesc, job: int, rows: int, partner: str, timeout_s: float):
        self.area = SyncArea(slot_bytes(actor, desc, SyncArea.nbytes(rows)), rows, fence=lambda: None)
        self.clock = Clock(partner, timeout_s, actor.interrupted, actor.beat, actor.ctx.heartbeat_s)
        self.job, self.step = job, 0

    def begin(self):
        self.area.header[0] = FORWARD

    def post(self, word: int, step: int):
        self.area.post(word, self.job, step)

    def end(self):
        self.area.header[0] = END
        self.step += 1
        self.post(VERIFIER_WORD, self.step)

    def ended(self) -> bool:
        return int(self.area.header[0]) == END

    def abandon(self):
        self.post(VERIFIER_WORD, ABANDONED)

    def wait(self, word: int, step: int, what: str, newer_ends: bool = False) -> bool:
        return self.area.wait(word, self.job, step, what, self.clock, newer_ends)


class FakeLoaderActor(FakeActor):
    """Fills the slot it is given with a stamp, and nowhere else: the loader's memory bound."""

    role = "loader"
    DURATIONS = {"load": (0.0005, 0.001)}

    def __init__(self, init: dict, ctx):
        super().__init__(init, ctx)
        self.groups = dict(self.model.get("groups", {}))
        self.region = init.get("stream_bytes")  # the loader may write [0, region) of the arena
        self.loads = self.bytes = self.max_end = 0
        self.loaded: deque = deque(maxlen=LOG_ENTRIES)  # (group, time.monotonic() at the end of its load)

    def op_groups(self):
        return GroupSizes(self.groups, sum(self.groups.values()))

    def op_load(self, group: str, tensors: dict):
        name = group
        if name not in self.groups:
            raise ValueError(f"the fake store has no group {name!r}")
        desc, n = tensors.get("slot"), self.groups[name]
        if not isinstance(desc, TensorDesc) or desc.span_bytes < n:
            raise ValueError(f"the slot given for {name} cannot hold its {n} bytes")
        end = desc.offset + n
        if self.region is not None and end > self.region:
            raise ValueError(
                f"loading {name} into bytes [{desc.offset}, {end}) would write past the loader's "
                f"{self.region}-byte region of the arena: the memory bound would be broken"
            )
        t = time.perf_counter()
        self.work("load", span=f"load:{name}")
        stamp_slot(slot_bytes(self, desc, n), self.loads, name)
        seconds = time.perf_counter() - t
        self.loads += 1
        self.bytes += n
        self.max_end = max(self.max_end, end)
        self.loaded.append((name, time.monotonic()))
        return Loaded(name, n, seconds, n / max(seconds, 1e-9) / 1e9, True)

    def op_stats(self):
        return {
            **super().op_stats(),
            "loads": self.loads,
            "bytes": self.bytes,
            "max_end": self.max_end,
            "region": self.region,
            "loaded": list(self.loaded),
        }


class FakeSparseAttnActor(FakeActor):
    """The worker: one `serve` per split job, meeting the verifier in the sync area step by step
    until it ends the job. Its share arrives in the verifier's init; its column share in its own."""

    role = "sparse"
    DURATIONS = {"attn": (0.0002, 0.0004), "cols": (0.0001, 0.0002)}

    def __init__(self, init: dict, ctx):
        super().__init__(init, ctx)
        self.columns = float(init.get("columns") or 0.0)
        self.capacity = None
        self.steps = 0

    def op_serve(self, job: int, rows: int, timeout_s: float, tensors: dict, capacity: int | None = None):
        if "kv" in tensors:
            self.capacity = capacity
        if self.capacity is None:
            raise RuntimeError("no KV cache bound: a prompt's first job (start) brings it")
        sync = FakeSync(self, tensors["sync"], job, rows, "the verifier", timeout_s)
        while True:
            step = sync.step + 1
            if not sync.wait(VERIFIER_WORD, step, f"step {step}", newer_ends=True) or sync.ended():
                return {"steps": sync.step}
            part = "cols" if self.columns > 0 and step % 2 == 0 else "attn"
            self.work(part, self.columns if part == "cols" else 1.0, span=f"sparse:{part}")
            sync.step = step
            self.steps += 1
            sync.post(WORKER_WORD, step)

    def op_stats(self):
        return {
            **super().op_stats(),
            "columns": self.columns,
            "capacity": self.capacity,
            "steps": self.steps,
        }


FAKES = {
    "verifier": "tests.runtime.fakes.target:FakeVerifierActor",
    "draft": "tests.runtime.fakes.target:FakeDraftActor",
    "loader": f"tests.runtime.fakes.actors:{FakeLoaderActor.__name__}",
    "sparse": f"tests.runtime.fakes.actors:{FakeSparseAttnActor.__name__}",
}
