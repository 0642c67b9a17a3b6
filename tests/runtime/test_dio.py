"""shm/dio.py: direct reads into arena slots, exact bytes at any alignment, no page cache left behind,
the tmpfs fallback, and clear errors. Files live on the real disk (/var/tmp), never on tmpfs."""

from __future__ import annotations

import ctypes
import os
import random
import secrets
import shutil

import numpy as np
import pytest

from shm.arena import Arena, new_run_id
from shm.dio import MEMORY_FS, DirectReader, cached_bytes, evict_page_cache, fs_type
from shm.slots import SlotAllocator

MiB = 1 << 20


@pytest.fixture(scope="module")
def disk_dir():
    d = os.path.join("/var/tmp", f"cadence-test-dio-{secrets.token_hex(3)}")
    os.makedirs(d)
    if fs_type(d) in MEMORY_FS:
        shutil.rmtree(d)
        pytest.skip(f"/var/tmp is on {fs_type(d)}: these tests need a file on a real disk")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def write_file(path: str, nbytes: int, seed: int = 0) -> bytes:
    data = np.random.default_rng(seed).bytes(nbytes)
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())  # clean pages: eviction can drop them
    return data


@pytest.fixture(scope="module")
def big(disk_dir):
    """24 MiB + 1234 bytes: a tail that is not a whole 4 KiB block."""
    path = os.path.join(disk_dir, "big.bin")
    return path, write_file(path, 24 * MiB + 1234, seed=1)


@pytest.fixture
def arena():
    a = Arena.create(new_run_id(), "dio", 32 * MiB)
    yield a
    a.close()
    a.unlink()


def test_direct_read_into_a_slot_is_exact_and_leaves_nothing_cached(big, arena):
    path, data = big
    with open(path, "rb") as f:  # cache it all first, so eviction has something to prove
        f.read()
    assert cached_bytes(path) == len(data)
    assert evict_page_cache([path]) == len(data)
    assert cached_bytes(path) == 0
    slots = SlotAllocator(arena.nbytes)
    slots.alloc(5000)  # the slot under test does not start at offset 0
    slot = slots.alloc(len(data))
    with DirectReader(path, threads=4, chunk_bytes=MiB) as r:
        assert r.direct and r.fallback_reason is None
        st = r.read_into(0, len(data), arena.buf, slot.offset)
    assert bytes(arena.buf[slot.offset : slot.offset + len(data)]) == data
    assert (
        st.direct and st.bytes == len(data) and st.seconds > 0 and st.gbps == pytest.approx(st.bytes / st.seconds / 1e9)
    )
    assert cached_bytes(path) == 0  # O_DIRECT went around the page cache, the unaligned tail too


@pytest.mark.parametrize("direct", [True, False])
def test_any_offset_length_and_destination_alignment(big, direct, seed):
    """Random ranges into random destination offsets (in and out of the file's 4 KiB phase): exact
    bytes, and not one byte of the destination outside the range is touched."""
    path, data = big
    rng = random.Random(seed)
    dest = np.full(4 * MiB + 3 * 4096, 0xA5, dtype=np.uint8)
    with DirectReader(path, threads=3, chunk_bytes=64 * 1024, direct=direct) as r:
        for _ in range(40):
            n = rng.choice([1, 7, 4095, 4096, 4097, 65536, 65537, 300_000, 4 * MiB])
            off = rng.choice([0, 4096, rng.randrange(len(data) - n + 1), len(data) - n])
            d = rng.choice([0, 4096, off % 4096, rng.randrange(len(dest) - n + 1)])
            d = min(d, len(dest) - n)
            r.read_into(off, n, dest, d)
            assert dest[d : d + n].tobytes() == data[off : off + n], (off, n, d)
            assert (dest[:d] == 0xA5).all() and (dest[d + n :] == 0xA5).all(), (off, n, d)
            dest[d : d + n] = 0xA5
    if not direct:
        assert cached_bytes(path) == 0  # dropped after each chunk, and no readahead past them


def test_a_ctypes_address_works_as_a_destination(big):
    path, data = big
    buf = ctypes.create_string_buffer(3 * MiB)
    with DirectReader(path, threads=2, chunk_bytes=MiB) as r:
        r.read_into(4096 * 5, 2 * MiB, ctypes.addressof(buf), 4096)
    assert buf.raw[4096 : 4096 + 2 * MiB] == data[4096 * 5 : 4096 * 5 + 2 * MiB]


def test_one_thread_or_many_and_any_chunk_give_the_same_bytes(big):
    path, data = big
    out = []
    for threads, chunk in ((1, 4096), (1, 16 * MiB), (8, 64 * 1024), (8, MiB)):
        dest = bytearray(len(data) + 4096)
        mv = memoryview(dest)
        with DirectReader(path, threads=threads, chunk_bytes=chunk) as r:
            r.read_into(0, len(data), mv, 4096 - 1234)  # an unaligned destination: the bounce path
        out.append(bytes(dest[4096 - 1234 : 4096 - 1234 + len(data)]))
    assert all(o == data for o in out)


def test_the_buffered_fallback_drops_what_it_read(disk_dir):
    path = os.path.join(disk_dir, "buffered.bin")
    data = write_file(path, 8 * MiB, seed=2)
    evict_page_cache([path])
    dest = bytearray(len(data))
    with DirectReader(path, threads=2, chunk_bytes=MiB, direct=False) as r:
        assert not r.direct and r.fallback_reason is None  # asked for: no warning
        st = r.read_into(0, len(data), dest)
    assert bytes(dest) == data and not st.direct
    assert cached_bytes(path) == 0


def test_tmpfs_falls_back_to_buffered_reads_and_warns_once():
    path = f"/dev/shm/dio-test-{secrets.token_hex(4)}"
    try:
        data = write_file(path, 2 * MiB + 100, seed=3)
        warnings = []
        with DirectReader(path, threads=2, chunk_bytes=256 * 1024, direct=True, warn=warnings.append) as r:
            assert not r.direct
            for _ in range(3):
                dest = bytearray(len(data))
                st = r.read_into(0, len(data), dest)
                assert bytes(dest) == data and not st.direct
        assert len(warnings) == 1
        assert "direct I/O is impossible on tmpfs" in warnings[0] and "page cache" in warnings[0]
        assert r.fallback_reason == warnings[0]
    finally:
        os.unlink(path)


def test_clear_errors(big, disk_dir):
    path, data = big
    with DirectReader(path, threads=2) as r:
        with pytest.raises(
            ValueError,
            match=rf"cannot read bytes \[{len(data) - 10}, {len(data) + 1}\) of .*big.bin: "
            rf"the file has {len(data)} bytes",
        ):
            r.read_into(len(data) - 10, 11, bytearray(4096))
        with pytest.raises(ValueError, match="does not fit at offset 10 of a 4096-byte destination"):
            r.read_into(0, 4096, bytearray(4096), 10)
        with pytest.raises(ValueError, match="ints >= 0"):
            r.read_into(-1, 10, bytearray(4096))
        assert r.read_into(5, 0, bytearray(0)).bytes == 0
    with pytest.raises(ValueError, match="chunk_bytes must be a positive multiple of 4096"):
        DirectReader(path, chunk_bytes=1000)
    with pytest.raises(ValueError, match="threads must be"):
        DirectReader(path, threads=0)
    with pytest.raises(FileNotFoundError):
        DirectReader(os.path.join(disk_dir, "missing.bin"))


def test_a_long_read_beats_on_the_calling_thread(big):
    path, data = big
    beats = []
    with DirectReader(path, threads=1, chunk_bytes=4096) as r:  # ~6k small reads: tens of ms at least
        r.read_into(0, len(data) // 2, bytearray(len(data) // 2), beat=lambda: beats.append(1), beat_s=0.001)
    assert beats


def test_an_interrupted_read_returns_only_once_nothing_writes_into_the_destination(big):
    path, data = big

    def beat():
        raise KeyboardInterrupt  # e.g. Ctrl-C while waiting

    dest = np.zeros(len(data), dtype=np.uint8)
    with DirectReader(path, threads=2, chunk_bytes=4096) as r:
        with pytest.raises(KeyboardInterrupt):
            r.read_into(0, len(data), dest, beat=beat, beat_s=0.0001)
        snapshot = dest.copy()
        assert r._pool._work_queue.empty()  # the rest was cancelled...
        assert r.read_into(0, 4096, bytearray(4096)).bytes == 4096  # ...and the reader still works
    assert (dest == snapshot).all()  # nothing wrote into it after the call returned
    assert dest.tobytes() != data and dest[:4096].tobytes() == data[:4096]  # it stopped part way
