"""FAKE actors, for integration tests: the four roles speaking the real ops, with no model.

`ActorSpeculation(..., impl=FAKES)` spawns these instead of the real actors, so the scheduler that
`launch run` uses is driven in seconds. They sleep instead of computing and move real bytes through
the real arena:
- the target is a pure function of the text (`target_next`: a hash of the last two tokens), so a
  speculative run must give exactly `target_text`; the fake draft proposes trees whose tokens are
  the target's with probability `accept_p` (seeded);
- the fake loader stamps each slot it fills (magic, load number, group, bytes, then a byte pattern)
  and writes nowhere else; the fake verifier checks the whole stamp before and after "computing" a
  streamed group, and that load numbers only grow, so a slot reused before its release, or a stale
  one, fails the request loudly.

The fake model is a directory standing in for the weight store (the `store` / `store_dir` every real
actor is given): `fake.json` there (`write_fake_store`) holds the vocabulary, the target's groups in
forward order with their bytes, the seed, and each role's script:
  durations {key: [min_s, max_s]}  seeded sleeps (verifier: "group" per group of a forward, "dense",
                                   "cols"; draft: "build", "ahead" per step; loader: "load";
                                   sparse: "attend", "cols")
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
from actors.ops import Advance, Ahead, Build, DraftStart, Groups, Load, Lookup
from shm.desc import TensorDesc

SCRIPT = "fake.json"
PREFILL_CHUNK = 256  # prompt rows per forward, as models/engine.py
_MAGIC = b"CDNCLOAD"
_HEAD = struct.Struct("<8sq32sq")  # magic, load number, group name, bytes
_LOG = 4096  # entries kept in the logs `stats` reports


def target_next(tokens: list[int], vocab: int) -> int:
    """The fake target's greedy choice after `tokens`: a function of the last two."""
    a, b = (tokens[-2] if len(tokens) > 1 else -1), tokens[-1]
    return zlib.crc32(struct.pack("<2q", a, b)) % vocab


def target_text(prompt: list[int], n: int, vocab: int) -> list[int]:
    """What the fake target alone generates: `n` tokens after `prompt`."""
    text = list(prompt)
    for _ in range(n):
        text.append(target_next(text, vocab))
    return text[len(prompt):]


def write_fake_store(path, groups: dict[str, int], vocab: int = 64, seed: int = 0, **roles) -> str:
    """A fake model in `path`: `groups` name -> bytes in forward order; `roles` role -> script."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / SCRIPT).write_text(json.dumps({"vocab": vocab, "groups": groups, "seed": seed, **roles}))
    return str(path)


def _bytes(actor: Actor, desc: TensorDesc, n: int | None = None) -> np.ndarray:
    """The slot's first `n` bytes (all of it by default) as a numpy view of the arena: no copy."""
    arena = actor.arenas[desc.segment]
    n = desc.span_bytes if n is None else n
    if n > desc.span_bytes or desc.offset + n > arena.nbytes:
        raise ValueError(f"{n} bytes at offset {desc.offset} reach past the slot or the end of {arena.name}")
    return np.frombuffer(arena.buf, dtype=np.uint8, count=n, offset=desc.offset)


def _pattern(seq: int) -> int:
    return (seq * 131 + 7) & 0xFF


def stamp_slot(buf: np.ndarray, seq: int, group: str) -> None:
    buf[_HEAD.size:] = _pattern(seq)
    buf[:_HEAD.size] = np.frombuffer(_HEAD.pack(_MAGIC, seq, group.encode(), buf.size), dtype=np.uint8)


def check_slot(buf: np.ndarray, group: str) -> int:
    """The load number of the stamp `group` left in `buf`; ValueError if it is not all there."""
    magic, seq, got, n = _HEAD.unpack(buf[:_HEAD.size].tobytes())
    got = got.rstrip(b"\0").decode(errors="replace")
    if magic != _MAGIC or got != group or n != buf.size:
        raise ValueError(f"the slot for {group} holds {got or 'no load'} ({n} bytes, load {seq}): "
                         "it was overwritten before its consumer released it, or never loaded")
    if not (buf[_HEAD.size:] == _pattern(seq)).all():
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
            return wire.Reply(req.req_id, False, {}, {}, f"ValueError: scripted failure of {req.op} (request {n} of it)")
        return super().handle(req)

    def work(self, key: str, share: float = 1.0, span: str = "compute") -> None:
        lo, hi = self.durations.get(key, (0.0, 0.0))
        seconds = self.rng.uniform(lo, hi) * share
        if seconds > 0:
            with self.trace.span(span, cat=self.role, args={"s": round(seconds, 6)}):
                time.sleep(seconds)

    def op_stats(self, args, tensors):
        return {**super().op_stats(args, tensors), "calls": dict(self.calls)}

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


class FakeVerifierActor(FakeActor):
    """The target. Resident (`start`, `step`, `verify`) or job mode (`begin`, then `layer` for each
    streamed group and, with the worker, `dense` + `merge` / `cols` + `cols_done`) as the real one."""

    role = "verifier"
    DURATIONS = {"group": (0.0002, 0.0005)}

    def __init__(self, init: dict, ctx):
        super().__init__(init, ctx)
        self.order = list(self.model.get("groups", {}))
        resident = init.get("resident")
        self.streamed = set() if resident is None else set(self.order) - set(resident)
        self.worker = init.get("worker")
        self.share = float((self.worker or {}).get("share", 0.0))
        self.columns = float((self.worker or {}).get("columns", 0.0))
        self.text: list[int] = []  # what the KV cache holds
        self.job = self.need = None
        self.slots: dict = {}
        self.last_load = -1  # load numbers of the slots consumed only grow
        self.consumed: deque = deque(maxlen=_LOG)  # (group, load number)
        self.begun: deque = deque(maxlen=_LOG)  # (job, time.monotonic()) of each `begin`

    # -- the target ------------------------------------------------------------------------------

    def _forward(self, rows: int):
        """One pass over the target's groups in order: yields what it needs from outside, as the
        real verifier's job does, and is sent the tensors of the op that brings it."""
        split = self.worker is not None and rows > 1
        for g in self.order:
            if g in self.streamed:
                tensors = yield {"need": g}
                buf = _bytes(self, tensors["slot"], self.model["groups"][g])
                seq = check_slot(buf, g)
                if seq <= self.last_load:
                    raise ValueError(f"the slot for {g} holds load {seq}, older than load {self.last_load} used before it")
                self.work("group", 1.0 - self.share, span=f"compute:{g}")
                check_slot(buf, g)  # nobody wrote into it while we used it
                self.last_load = seq
                self.consumed.append((g, seq))
            else:
                self.work("group", 1.0 - self.share, span=f"compute:{g}")
            if split and g.startswith("layer."):
                i = int(g.split(".")[1])
                _bytes(self, self.slots["q"], 16)[:] = np.array([i, rows], dtype="<i8").view(np.uint8)
                yield {"need": "attn", "layer": i, "T": rows, "n_shared": len(self.text), "k0": 0, "maxc": 1,
                       "scale": 1.0, **({"ptr": [0] * (rows + 1), "idx": []} if i == 0 else {})}
                if self.columns > 0:
                    yield {"need": "cols", "layer": i, "name": "wo", "T": rows, "acc": True, "n0": 1}

    def _start(self, prompt: list[int]):
        reused = 0
        while reused < min(len(prompt) - 1, len(self.text)) and prompt[reused] == self.text[reused]:
            reused += 1
        for i in range(reused, len(prompt), PREFILL_CHUNK):
            yield from self._forward(min(PREFILL_CHUNK, len(prompt) - i))
        self.text = list(prompt)
        return {"token": target_next(self.text, self.vocab), "reused": reused}

    def _step(self, root: int):
        yield from self._forward(1)
        self.text.append(root)
        return {"token": target_next(self.text, self.vocab), "reused": 0}

    def _verify(self, tree: dict):
        """Greedy: from the root, the child holding the target's token, while there is one."""
        tokens, parents = list(tree["tokens"]), list(tree["parents"])
        yield from self._forward(len(tokens) + 1)
        self.text.append(int(tree["root"]))
        path, at = [], -1
        while True:
            want = target_next(self.text, self.vocab)
            nxt = next((j for j, (t, p) in enumerate(zip(tokens, parents)) if p == at and t == want), None)
            if nxt is None:
                return {"path": path, "next": want, "rows": len(tokens) + 1}
            path.append(nxt)
            self.text.append(want)
            at = nxt

    def _job(self, kind: str, args: dict):
        if kind == "start":
            return self._start(list(args["prompt_ids"]))
        if kind == "step":
            return self._step(int(args["root"]))
        if kind == "verify":
            return self._verify(args)
        raise ValueError(f"unknown job {kind!r}; use start, step or verify")

    # -- resident --------------------------------------------------------------------------------

    def _whole(self, kind: str, args: dict) -> dict:
        job = self._job(kind, args)
        try:
            need = next(job)
        except StopIteration as done:
            return done.value
        raise RuntimeError(f"a resident {kind} needs {need}: this verifier was started with streamed groups or a worker")

    def op_start(self, args, tensors):
        return self._whole("start", args)

    def op_step(self, args, tensors):
        return self._whole("step", args)

    def op_verify(self, args, tensors):
        return self._whole("verify", args)

    # -- job mode ----------------------------------------------------------------------------------

    def op_begin(self, args, tensors):
        if self.job is not None:
            raise RuntimeError(f"a job is still waiting for {self.need}")
        self.begun.append((args["job"], time.monotonic()))
        self.slots.update((k, v) for k, v in tensors.items() if k in ("q", "ch", "kv", "x", "xin", "y"))
        self.job = self._job(args["job"], args)
        return self._resume(None)

    def op_layer(self, args, tensors):
        if self.job is None or args["group"] != (self.need or {}).get("need"):
            raise RuntimeError(f"layer {args['group']} arrived but the verifier waits for {self.need}")
        return self._resume(tensors)

    def op_dense(self, args, tensors):
        self.work("dense", 1.0 - self.share, span=f"dense:layer.{self.need['layer']}")
        return {}

    def op_merge(self, args, tensors):
        """The worker's chunk states are where it was told to write them: in our `ch` slot."""
        want = [self.need["layer"], self.need["T"]]
        got = _bytes(self, self.slots["ch"], 16).view("<i8").tolist()
        if got != want or len(args["nch"]) != self.need["T"]:
            raise ValueError(f"the worker's chunk states hold layer, rows {got}, not {want}")
        return self._resume(None)

    def op_cols(self, args, tensors):
        self.work("cols", 1.0 - self.columns)
        return {}

    def op_cols_done(self, args, tensors):
        return self._resume(None)

    def _resume(self, value) -> dict:
        try:
            self.need = self.job.send(value)
        except StopIteration as done:
            self.job = self.need = None
            return {"done": done.value}
        return self.need

    def op_stats(self, args, tensors):
        return {**super().op_stats(args, tensors), "worker": self.worker, "streamed": sorted(self.streamed),
                "consumed": list(self.consumed), "begun": list(self.begun)}


class FakeDraftActor(FakeActor):
    """The draft: a tree (or chain) whose tokens are the target's with probability `accept_p`."""

    role = "draft"
    DURATIONS = {"build": (0.0005, 0.001), "ahead": (0.0005, 0.001)}

    def __init__(self, init: dict, ctx):
        super().__init__(init, ctx)
        self.accept_p = float(self.script.get("accept_p", 0.7))
        self.tree = dict(init.get("tree", {}))
        self.text: list[int] = []
        self.depth = 0  # of the last tree built
        self.alpha = 0.5

    def op_start(self, args: DraftStart, tensors):
        self.tree = dict(args.tree or self.tree)
        self.text = list(args.prompt_ids) + [args.first]
        return {}

    def _grow(self, budget: int, chain: bool, max_depth: int) -> dict:
        """A chain of guesses; in tree mode each guess has a sibling leaf holding the other candidate."""
        v, text = self.vocab, list(self.text)
        tokens, parents, probs, parent, tc = [], [], [], -1, 1.0
        while len(tokens) < budget and len(text) - len(self.text) < max_depth:
            right = target_next(text, v)
            wrong = (right + 1 + self.rng.randrange(v - 1)) % v
            hit = self.rng.random() < self.accept_p
            tokens.append(right if hit else wrong)
            parents.append(parent)
            probs.append(0.9 if hit else 0.6)
            me = len(tokens) - 1
            tc *= probs[me]
            if not chain and len(tokens) < budget:
                tokens.append(wrong if hit else right)
                parents.append(parent)
                probs.append(0.1 if hit else 0.4)
            parent = me
            text.append(tokens[me])
        self.depth = len(text) - len(self.text)
        return {"root": self.text[-1], "tokens": tokens, "parents": parents, "probs": probs, "tc": tc}

    def op_build(self, args: Build, tensors):
        self.work("build")
        chain = self.tree.get("mode") == "chain"
        tree = self._grow(args.budget, chain, int(self.tree.get("max_depth", 8)))
        return {**tree, "forwards": self.depth, "trie_nodes": 0}

    def op_lookup(self, args: Lookup, tensors):
        """The trie's candidates: sometimes none, else a short chain."""
        if self.rng.random() < 0.5:
            return {"tokens": []}
        tree = self._grow(min(2, args.max_nodes), True, 2)
        return {**tree, "forwards": 0, "trie_nodes": len(tree["tokens"])}

    def op_ahead(self, args: Ahead, tensors):
        steps = 0
        while steps < args.steps and not self.interrupted():
            self.work("ahead")
            steps += 1
        return {"steps": steps}

    def op_advance(self, args: Advance, tensors):
        path, new = list(args.path), list(args.new)
        self.text += new
        if args.tree and self.depth:
            self.alpha = 0.8 * self.alpha + 0.2 * len(path) / self.depth
        return {"alpha": round(self.alpha, 6), "ahead_steps": 0, "ahead_reused": 0}


class FakeLoaderActor(FakeActor):
    """Fills the slot it is given with a stamp, and nowhere else: the loader's memory bound."""

    role = "loader"
    DURATIONS = {"load": (0.0005, 0.001)}

    def __init__(self, init: dict, ctx):
        super().__init__(init, ctx)
        self.groups = dict(self.model.get("groups", {}))
        self.region = init.get("stream_bytes")  # the loader may write [0, region) of the arena
        self.loads = self.bytes = self.max_end = 0
        self.loaded: deque = deque(maxlen=_LOG)  # (group, time.monotonic() at the end of its load)

    def op_groups(self, args: Groups, tensors):
        return {"groups": self.groups, "file_bytes": sum(self.groups.values())}

    def op_load(self, args: Load, tensors):
        name = args.group
        if name not in self.groups:
            raise ValueError(f"the fake store has no group {name!r}")
        desc, n = tensors.get("slot"), self.groups[name]
        if not isinstance(desc, TensorDesc) or desc.span_bytes < n:
            raise ValueError(f"the slot given for {name} cannot hold its {n} bytes")
        end = desc.offset + n
        if self.region is not None and end > self.region:
            raise ValueError(f"loading {name} into bytes [{desc.offset}, {end}) would write past the loader's "
                             f"{self.region}-byte region of the arena: the memory bound would be broken")
        t = time.perf_counter()
        self.work("load", span=f"load:{name}")
        stamp_slot(_bytes(self, desc, n), self.loads, name)
        seconds = time.perf_counter() - t
        self.loads += 1
        self.bytes += n
        self.max_end = max(self.max_end, end)
        self.loaded.append((name, time.monotonic()))
        return {"group": name, "bytes": n, "seconds": seconds, "gbps": n / max(seconds, 1e-9) / 1e9, "direct": True}

    def op_stats(self, args, tensors):
        return {**super().op_stats(args, tensors), "loads": self.loads, "bytes": self.bytes, "max_end": self.max_end,
                "region": self.region, "loaded": list(self.loaded)}


class FakeSparseAttnActor(FakeActor):
    """The worker: `bind` a KV cache, `attend` (writes the layer and rows it did where the verifier
    merges from), `cols`. Its share arrives in the verifier's init; its column share in its own."""

    role = "sparse"
    DURATIONS = {"attend": (0.0002, 0.0004), "cols": (0.0001, 0.0002)}

    def __init__(self, init: dict, ctx):
        super().__init__(init, ctx)
        self.columns = float(init.get("columns") or 0.0)
        self.capacity = None

    def op_bind(self, args, tensors):
        self.capacity = int(args["capacity"])
        return {}

    def op_attend(self, args, tensors):
        if self.capacity is None:
            raise RuntimeError("attend before bind: no KV cache to read")
        want = [int(args["layer"]), int(args["T"])]
        got = _bytes(self, tensors["q"], 16).view("<i8").tolist()
        if got != want:
            raise ValueError(f"Q in the arena is for layer, rows {got}, not {want}")
        self.work("attend", span=f"sparse:layer.{want[0]}")
        _bytes(self, tensors["out"], 16)[:] = np.array(want, dtype="<i8").view(np.uint8)
        return {"nch": [1] * want[1]}

    def op_cols(self, args, tensors):
        if not self.columns:
            raise RuntimeError("this worker was started without a column share")
        self.work("cols", self.columns)
        return {}

    def op_stats(self, args, tensors):
        return {**super().op_stats(args, tensors), "columns": self.columns, "capacity": self.capacity}


FAKES = {role: f"actors.fake:{cls.__name__}" for role, cls in (
    ("verifier", FakeVerifierActor), ("draft", FakeDraftActor), ("loader", FakeLoaderActor), ("sparse", FakeSparseAttnActor))}
