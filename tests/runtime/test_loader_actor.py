"""The real I/O loader under a real scheduler: every group of a small weight store into arena
slots, the whole model streamed through two slots under a budget smaller than the model (leases,
every slot released, the page cache left empty), and a SIGKILL mid-load."""

from __future__ import annotations

import json
import os
import random
import secrets
import shutil
import signal
import threading
import zlib
from collections import deque

import pytest
import torch

from models.args import ModelArgs
from formats.store import StoreWriter
from text.tokenizer import TokenizerInfo
from scheduler.runtime_config import GiB, KiB, MemoryConfig, PipelineConfig, RuntimeConfig, Timeouts, TraceConfig
from scheduler.errors import ActorDead, ActorError
from scheduler.runtime import Runtime
from scheduler.events import DeadEvent, ReplyEvent
from scheduler.trace import validate_trace
from shm.desc import TensorDesc
from shm.dio import MEMORY_FS, cached_bytes, evict_page_cache, fs_type
from tests.runtime.conftest import assert_clean

LOADER = "actors.loader:LoaderActor"
CONSUMER = "tests.runtime.actors_for_tests:ChecksumActor"
N_LAYERS = 4


@pytest.fixture(scope="module")
def store():
    """A 4-layer weight store of random tensors, on the real disk: ~3.5 MiB, groups of odd sizes."""
    d = os.path.join("/var/tmp", f"cadence-test-loader-{secrets.token_hex(3)}")
    os.makedirs(d)
    if fs_type(d) in MEMORY_FS:
        shutil.rmtree(d)
        pytest.skip("/var/tmp is on tmpfs: the loader tests need a real disk")
    g = torch.Generator().manual_seed(0)
    args = ModelArgs(
        arch="qwen2",
        vocab_size=1000,
        dim=128,
        n_layers=N_LAYERS,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=320,
        norm_eps=1e-6,
        rope_base=10000.0,
        context_length=256,
        qkv_bias=True,
        tied_embeddings=False,
    )
    w = StoreWriter(os.path.join(d, "store"))
    w.add("embed", "embed", "float", {"w": torch.randn(1000, 128, generator=g)})
    for i in range(N_LAYERS):
        w.add(
            f"layer.{i}",
            f"layers.{i}.attn",
            "float",
            {"w": torch.randn(128, 384 + 8 * i, generator=g), "b": torch.randn(384 + 8 * i, generator=g)},
        )
        w.add(f"layer.{i}", f"layers.{i}.ffn", "float", {"w": torch.randn(3, 320, 128, generator=g).to(torch.bfloat16)})
        w.add(f"layer.{i}", f"layers.{i}.norm", "float", {"w": torch.randn(128 + i, generator=g)})
    w.add("head", "head", "float", {"w": torch.randn(1000, 128, generator=g).to(torch.float16)})
    w.finish({"model": args.to_dict(), "format": "f32"}, TokenizerInfo("{}", None, []))
    path = os.path.join(d, "store")
    os.sync()  # clean pages: eviction can drop them
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    with open(os.path.join(path, "weights.bin"), "rb") as f:
        blob = f.read()
    groups = {gr["name"]: blob[gr["offset"] : gr["offset"] + gr["nbytes"]] for gr in manifest["groups"]}
    yield path, groups
    shutil.rmtree(d, ignore_errors=True)


def config(stream_bytes: int, trace_dir=None, **timeouts) -> RuntimeConfig:
    return RuntimeConfig(
        memory=MemoryConfig(
            budget_bytes=4 * GiB, arena_bytes=stream_bytes + 256 * KiB, stream_bytes=stream_bytes, sample_s=0
        ),
        pipeline=PipelineConfig(layer_bytes=64 * KiB),
        timeouts=Timeouts(**{"hello_s": 60.0, "init_s": 60.0, "ready_s": 90.0, "request_s": 20.0, **timeouts}),
        trace=TraceConfig(enabled=trace_dir is not None, dir=str(trace_dir) if trace_dir else None),
    )


def loader_init(store_path: str, s: Runtime, **kw) -> dict:
    return {
        "store_dir": store_path,
        "threads": 4,
        "chunk_bytes": 64 * KiB,
        "stream_bytes": s.config.memory.stream_bytes,
        **kw,
    }


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"threads": "four"}, "argument 'threads' must be int, got str"),
        ({"stream_byte": 1}, "unknown argument\\(s\\) stream_byte"),
        ({"store_dir": None}, "argument 'store_dir' must be str, got NoneType"),
    ],
)
def test_a_start_the_loader_cannot_read_fails_in_one_sentence_that_names_it(store, tmp_path, bad, match):
    """An actor's start is typed (actors/starts.py) and read at the boundary as an op's arguments are: a field of the
    wrong type, one it does not take, is said by name, not met later as a traceback deep in its setup."""
    path, _ = store
    with Runtime(config(4 << 20, tmp_path)) as s:
        with pytest.raises(
            ActorDead, match=f"the loader actor failed during setup: ValueError: the loader's start.*{match}"
        ):
            s.spawn("loader", LOADER, loader_init(path, s, **bad))


def test_every_group_lands_in_its_slot_byte_for_byte(store, tmp_path):
    path, groups = store
    weights = os.path.join(path, "weights.bin")
    evict_page_cache([weights])
    with Runtime(config(4 << 20, tmp_path)) as s:
        pid = s.spawn("loader", LOADER, loader_init(path, s)).pid
        sizes = s.call("loader", "groups").result["groups"]
        assert list(sizes) == ["embed", *[f"layer.{i}" for i in range(N_LAYERS)], "head"]
        for name, nbytes in sizes.items():
            slot = s.stream_slots.alloc(nbytes)
            r = s.call("loader", "load", {"group": name}, {"slot": s.slot_desc(slot)}).result
            assert bytes(s.arena.buf[slot.offset : slot.offset + nbytes]) == groups[name], name
            assert r["group"] == name and r["bytes"] == nbytes == len(groups[name]) and r["direct"] is True
            assert r["seconds"] > 0 and r["gbps"] > 0
            assert s.stream_slots.leases(slot) == {}  # the reply ended the loader's lease
            s.stream_slots.free(slot)
        stats = s.call("loader", "stats").result
        assert stats["loads"] == len(sizes) and stats["bytes"] == sum(sizes.values()) and stats["direct"]
        assert stats["gbps"] > 0 and stats["fallback_reason"] is None
        assert cached_bytes(weights) == 0, "direct reads filled the page cache"
    assert s.stream_slots.used_bytes == 0
    assert_clean(s.run_id, [pid])
    trace = json.loads(s.trace_path.read_text())
    assert validate_trace(trace) == []
    spans = [e for e in trace["traceEvents"] if e.get("cat") == "load" and e["ph"] == "X"]
    assert [e["name"] for e in spans] == [f"load:{n}" for n in sizes]
    assert all(e["args"]["bytes"] == sizes[e["name"][5:]] and e["args"]["gbps"] > 0 for e in spans)
    inflight = [e["args"]["bytes"] for e in trace["traceEvents"] if e["name"] == "loader bytes in flight"]
    assert max(inflight) == max(sizes.values()) and inflight[-1] == 0


def test_bad_loads_fail_clearly_and_the_loader_keeps_serving(store):
    path, groups = store
    with Runtime(config(4 << 20)) as s:
        s.spawn("loader", LOADER, loader_init(path, s, stream_bytes=1 << 20))
        small = s.stream_slots.alloc(4096)
        with pytest.raises(ActorError, match=r"has no group 'layer.9' \(it has embed ... head\)"):
            s.call("loader", "load", {"group": "layer.9"}, {"slot": s.slot_desc(small)})
        with pytest.raises(
            ActorError, match=r"cannot hold layer.0 \(\d+ bytes\); allocate the slot with the group's size"
        ):
            s.call("loader", "load", {"group": "layer.0"}, {"slot": s.slot_desc(small)})
        with pytest.raises(ActorError, match="load needs tensors\\['slot'\\]"):
            s.call("loader", "load", {"group": "layer.0"})
        # the real actor's ops are typed by their signatures (actors/calls.py): a wrong kind, an argument the op
        # does not take or one it lacks ends that request in one sentence; the loader serves on
        with pytest.raises(ActorError, match="op 'load': argument 'group' must be str, got int"):
            s.call("loader", "load", {"group": 0}, {"slot": s.slot_desc(small)})
        with pytest.raises(ActorError, match="op 'load' takes group: unknown argument\\(s\\) layer; missing argument"):
            s.call("loader", "load", {"layer": 0}, {"slot": s.slot_desc(small)})
        with pytest.raises(ActorError, match="op 'groups' takes no arguments: unknown argument\\(s\\) all"):
            s.call("loader", "groups", {"all": True})
        big = s.stream_slots.alloc(len(groups["layer.0"]) + (1 << 20))  # reaches past the 1 MiB region
        with pytest.raises(ActorError, match="past the loader's 1048576-byte region of the arena: the memory bound"):
            s.call(
                "loader",
                "load",
                {"group": "layer.0"},
                {
                    "slot": TensorDesc(
                        s.arena.name, big.offset + (1 << 20) - 4096, "uint8", (big.nbytes - (1 << 20) + 4096,), (1,)
                    )
                },
            )
        assert s.call("loader", "stats").result["loads"] == 0
    assert_clean(s.run_id)


def stream(s: Runtime, sizes: dict, order: list, check: dict | None = None, on_send=None, loads=None) -> int:
    """Load `order` through the loader slots: a load per slot that fits, each loaded slot handed
    to the consumer (leased to it) and freed by us at once, so only the lease keeps it until the
    consumer's reply. Returns the loads done. Asserts the bound after every step."""
    stream_slots, bound = s.stream_slots, s.config.memory.stream_bytes
    todo, reads, done = deque(order), {}, 0
    loads = {} if loads is None else loads  # req id -> (group, slot): loads in flight
    while todo or loads or reads:
        while todo and (slot := stream_slots.try_alloc(sizes[todo[0]])) is not None:
            name = todo.popleft()
            loads[s.send("loader", "load", {"group": name}, {"slot": s.slot_desc(slot)})] = (name, slot)
            if on_send:
                on_send()
        assert stream_slots.used_bytes <= bound
        for ev in s.poll(1.0):
            if isinstance(ev, DeadEvent):
                raise ev.error()
            assert isinstance(ev, ReplyEvent) and ev.reply.ok, ev
            if ev.role == "loader":
                name, slot = loads.pop(ev.reply.req_id)
                data = TensorDesc(s.arena.name, slot.offset, "uint8", (sizes[name],), (1,))
                reads[s.send("consumer", "crc", {"sleep_s": 0.002}, {"x": data})] = name
                stream_slots.free(slot)  # the owner is done: the consumer's lease holds the bytes
                done += 1
            else:
                name = reads.pop(ev.reply.req_id)
                assert check is None or ev.reply.result["crc"] == check[name], f"{name} arrived damaged"
    return done


def test_a_model_larger_than_the_budget_streams_through_two_slots(store):
    path, groups = store
    weights = os.path.join(path, "weights.bin")
    sizes = {n: len(b) for n, b in groups.items()}
    budget = 2 * max(sizes.values())  # two slots of the largest group; the model is ~3x that
    assert sum(sizes.values()) > budget
    crcs = {n: zlib.crc32(b) for n, b in groups.items()}
    evict_page_cache([weights])
    with Runtime(config(budget)) as s:
        pids = [
            s.spawn("loader", LOADER, loader_init(path, s), wait=False).pid,
            s.spawn("consumer", CONSUMER, wait=False).pid,
        ]
        s.wait_ready()
        order = list(sizes) * 3
        assert stream(s, sizes, order, crcs) == len(order)
        stats = s.call("loader", "stats").result
        assert stats["bytes"] == 3 * sum(sizes.values()) and stats["max_end"] <= budget  # where it wrote
        assert s.stream_slots.peak_bytes <= budget  # what the allocator ever held
        assert s.stream_slots.used_bytes == 0  # every slot came back...
        assert not s.stream_slots._leases and not s.stream_slots._freed  # ...with no lease left
        assert cached_bytes(weights) == 0  # and the model never sat in the page cache
    assert_clean(s.run_id, pids)


def test_a_loader_killed_mid_load_ends_the_run_with_one_reason(store, seed, tmp_path):
    path, groups = store
    sizes = {n: len(b) for n, b in groups.items()}
    # the kill lands a few ms after the k-th load is sent: a load (~15 ms of 4 KiB reads) is then in flight for
    # sure (a kill at a fixed time could land while both slots sat with the consumer and no load was out)
    rng = random.Random(seed)
    nth, delay = rng.randint(1, 30), rng.uniform(0.0, 0.005)
    s = Runtime(config(2 * max(sizes.values()), tmp_path))
    with pytest.raises(ActorDead) as e:
        with s:
            # one thread, 4 KiB chunks: each load takes long enough to be cut in the middle
            pids = [
                s.spawn("loader", LOADER, loader_init(path, s, threads=1, chunk_bytes=4096), wait=False).pid,
                s.spawn("consumer", CONSUMER, wait=False).pid,
            ]
            s.wait_ready()
            victim = s.actors["loader"].pid
            kill = threading.Timer(delay, os.kill, (victim, signal.SIGKILL))
            sent, loads = [], {}

            def arm():
                sent.append(1)
                if len(sent) == nth:
                    kill.start()

            try:
                stream(s, sizes, list(sizes) * 1000, on_send=arm, loads=loads)
            finally:
                kill.cancel()
                held = s.stream_slots.used_bytes
                leased = {
                    off: dict(+held_by) for off, held_by in s.stream_slots._leases.items()
                }  # a copy: replies still come
    assert str(e.value) == "the loader actor was killed by SIGKILL" and e.value.role == "loader"
    assert loads, "the loader died between loads, not in the middle of one"
    # the dead loader's leases were released; only our own allocations remain, and the consumer's lease on a
    # slot it was still reading when the loader died
    assert held > 0 and not any("loader" in by for by in leased.values()), leased
    assert_clean(s.run_id, pids)
    assert validate_trace(json.loads(s.trace_path.read_text())) == []
