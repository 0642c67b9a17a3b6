"""The actor runtime's benchmark, `launch runtime-bench` (BENCHMARKS.md, "Actor runtime").

- control round trip scheduler -> actor -> scheduler (`ping`), p50/p99, interleaved in blocks
  with a bare pyzmq ROUTER/DEALER echo on the same machine (the floor any ZeroMQ path pays);
- tensor handoff, 4 KiB .. 256 MiB: a descriptor into the arena (the tensor already there, as
  when the loader wrote it), the same plus the one copy in (`put`), and the same tensor
  pickled over ZeroMQ; the receiver maps or unpickles it and reads its first and last element;
- memcpy bandwidth of this machine, the physical reference for every copy above.
"""

from __future__ import annotations

import gc
import os
import pickle
import platform
import statistics
import subprocess
import sys
import threading
import time

import zmq

from actors.base import Actor
from common.timing import timed
from scheduler.runtime_config import GiB, KiB, MiB, MemoryConfig, PipelineConfig, RuntimeConfig, TraceConfig

SIZES = [4 * KiB * 4**i for i in range(9)]  # 4 KiB .. 256 MiB


class BenchActor(Actor):
    """`touch` maps a descriptor and reads two elements; a side thread serves pickles over a REP socket."""

    role = "bench"

    def __init__(self, init: dict, ctx):
        super().__init__(init, ctx)
        self._zctx = zmq.Context()
        self._rep = self._zctx.socket(zmq.REP)
        self._rep.bind(init["pickle_endpoint"])
        self._stop = False
        self._thread = threading.Thread(target=self._serve_pickles, name="pickle-server", daemon=True)
        self._thread.start()

    def op_touch(self, tensors: dict):
        t = self.tensor(tensors["x"]).view(-1)
        return {"first": float(t[0]), "last": float(t[-1])}

    def _serve_pickles(self):
        while not self._stop:
            if self._rep.poll(100):
                t = pickle.loads(self._rep.recv(copy=False).buffer).view(-1)
                self._rep.send(pickle.dumps((float(t[0]), float(t[-1]))))

    def close(self):
        self._stop = True
        self._thread.join(1.0)
        self._rep.close(linger=0)
        self._zctx.term()


_RAW_ECHO = """
import sys, zmq
s = zmq.Context().socket(zmq.DEALER); s.setsockopt(zmq.IDENTITY, b"echo"); s.connect(sys.argv[1])
s.send(b"hi")
while (f := s.recv_multipart()) != [b"q"]:
    s.send_multipart(f)
"""


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


class _RawEcho:
    """A bare pyzmq DEALER echo in another process: the floor any ZeroMQ control path pays."""

    def __init__(self, run_dir: str):
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        endpoint = f"ipc://{run_dir}/raw"
        self.router.bind(endpoint)
        self.child = subprocess.Popen([sys.executable, "-c", _RAW_ECHO, endpoint])
        self.router.recv_multipart()

    def ping(self) -> None:
        self.router.send_multipart([b"echo", b"\x10", b"\x85\xa2op\xa4ping"])
        self.router.recv_multipart()

    def close(self) -> None:
        self.router.send_multipart([b"echo", b"q"])
        try:
            self.child.wait(5)
        finally:
            if self.child.poll() is None:
                self.child.kill()
                self.child.wait()
            self.router.close(linger=0)
            self.ctx.term()


def bench_rtt(sched, n: int) -> tuple[dict, dict]:
    """Blocks of cadence pings and bare-pyzmq pings, interleaved so both see the same background load."""
    raw = _RawEcho(sched.run_dir)
    ours, floor = [], []
    try:
        for i in range(200):
            sched.call("echo", "ping", {"i": i})
            raw.ping()
        for block in range(10):
            for i in range(n // 10):
                t0 = time.perf_counter_ns()
                sched.call("echo", "ping", {"i": i})
                ours.append((time.perf_counter_ns() - t0) / 1000)
            for i in range(n // 10):
                t0 = time.perf_counter_ns()
                raw.ping()
                floor.append((time.perf_counter_ns() - t0) / 1000)
    finally:
        raw.close()
    return (
        {"p50_us": _pct(ours, 0.5), "p99_us": _pct(ours, 0.99), "n": len(ours)},
        {"p50_us": _pct(floor, 0.5), "p99_us": _pct(floor, 0.99), "n": len(floor)},
    )


def bench_handoff(sched, req, size: int, reps: int) -> dict:
    import torch
    from shm import tensors

    t = torch.rand(size // 4)  # float32, `size` bytes
    slot = sched.slots.alloc(size)
    desc = tensors.put(sched.arena, slot, t)
    in_place, with_put, pickled = [], [], []
    # one method at a time, pickle last: its 2 x size of garbage is freed (under the GIL, in both
    # processes) after each round, and would otherwise land inside the next method's timing
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        sched.call("echo", "touch", tensors={"x": desc})
        in_place.append(time.perf_counter_ns() - t0)
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        d = tensors.put(sched.arena, slot, t)
        sched.call("echo", "touch", tensors={"x": d})
        with_put.append(time.perf_counter_ns() - t0)
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        req.send(pickle.dumps(t), copy=False)
        pickle.loads(req.recv())
        pickled.append(time.perf_counter_ns() - t0)
    sched.slots.free(slot)
    del t
    gc.collect()
    time.sleep(0.3)  # let both processes give the pickled copies back before the next size
    med = lambda xs: statistics.median(xs) / 1000  # noqa: E731  (us)
    return {"bytes": size, "arena_us": med(in_place), "arena_put_us": med(with_put), "pickle_zmq_us": med(pickled)}


def bench_memcpy(size: int = 256 * MiB, reps: int = 5) -> dict:
    import numpy as np
    import torch

    src = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    best_np = min(timed(lambda: np.copyto(dst, src)) for _ in range(reps))
    ts, td = torch.from_numpy(src), torch.from_numpy(dst)
    best_t = min(timed(lambda: td.copy_(ts)) for _ in range(reps))
    return {
        "bytes": size,
        "numpy_copyto_GBps": size / best_np / 1e9,
        "torch_copy_GBps": size / best_t / 1e9,
        "torch_threads": torch.get_num_threads(),
    }


def _cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return platform.processor() or "unknown"


def measure(rounds: int, max_mib: int, memcpy_mib: int) -> dict:
    """Every measurement: {"machine", "rtt", "rtt_raw_pyzmq", "handoff", "memcpy"}."""
    from scheduler.runtime import Runtime

    sizes = [s for s in SIZES if s <= max_mib * MiB] or SIZES[:1]
    arena = max(sizes) + 16 * MiB
    config = RuntimeConfig(
        memory=MemoryConfig(budget_bytes=8 * GiB, arena_bytes=arena, stream_bytes=64 * KiB, sample_s=0),
        pipeline=PipelineConfig(layer_bytes=4 * KiB),
        trace=TraceConfig(enabled=False),
    )
    out = {"machine": {"cpu": _cpu_model(), "cores": os.cpu_count(), "python": platform.python_version()}}
    with Runtime(config) as sched:
        endpoint = f"ipc://{sched.run_dir}/pickle"
        sched.spawn("echo", BenchActor, {"pickle_endpoint": endpoint})
        out["rtt"], out["rtt_raw_pyzmq"] = bench_rtt(sched, rounds)
        zctx = zmq.Context()
        req = zctx.socket(zmq.REQ)
        req.connect(endpoint)
        try:
            out["handoff"] = [bench_handoff(sched, req, s, reps=30 if s <= 4 * MiB else 5) for s in sizes]
        finally:
            req.close(linger=0)
            zctx.term()
    out["memcpy"] = bench_memcpy(memcpy_mib * MiB)
    return out


def _size(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"


def format_table(out: dict) -> str:
    m, r, raw, mc = out["machine"], out["rtt"], out["rtt_raw_pyzmq"], out["memcpy"]
    lines = [
        f"machine: {m['cpu']}, {m['cores']} cores, python {m['python']}",
        "",
        "| control round trip (ping) | p50 | p99 |",
        "| --- | ---: | ---: |",
        f"| scheduler -> actor -> scheduler | {r['p50_us']:.0f} us | {r['p99_us']:.0f} us |",
        f"| bare pyzmq ROUTER/DEALER echo (floor) | {raw['p50_us']:.0f} us | {raw['p99_us']:.0f} us |",
        "",
        "| tensor | arena (descriptor) | arena incl. put (1 copy) | pickle over ZeroMQ |",
        "| ---: | ---: | ---: | ---: |",
    ]
    for h in out["handoff"]:
        lines.append(
            f"| {_size(h['bytes'])} | {h['arena_us']:.0f} us | {h['arena_put_us']:.0f} us | {h['pickle_zmq_us']:.0f} us |"
        )
    lines += [
        "",
        f"memcpy {_size(mc['bytes'])}: numpy copyto {mc['numpy_copyto_GBps']:.1f} GB/s, "
        f"torch copy_ ({mc['torch_threads']} threads) {mc['torch_copy_GBps']:.1f} GB/s",
    ]
    return "\n".join(lines)
