"""Reads from disk into memory around the page cache: O_DIRECT, 4 KiB-aligned, from a pool of threads.

`DirectReader.read_into` splits a byte range of a file into chunks on a fixed grid of the file
(multiples of `chunk_bytes`) and reads them in parallel with `os.preadv` straight into the
destination (an arena slot: 4 KiB-aligned, so the normal path copies nothing). Ends that are not
4 KiB-aligned, or a destination whose alignment does not match the file's, go through one bounce
buffer of at most `chunk_bytes` per thread. Where direct I/O is impossible (tmpfs keeps files in
memory anyway; some filesystems refuse O_DIRECT with EINVAL) the reader falls back to buffered
reads followed by `posix_fadvise(DONTNEED)`, and says so once, with the reason.

`evict_page_cache` drops files' cached pages, and `cached_bytes` measures residency with
`mincore`, so a test (or a benchmark) can prove that a read did not fill the page cache.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np

from common.errors import CadenceError

ALIGN = 4096
MiB = 1 << 20
DEFAULT_CHUNK = 4 * MiB
MEMORY_FS = ("tmpfs", "ramfs", "hugetlbfs")  # the file lives in memory: there is no disk to bypass

log = logging.getLogger("cadence.dio")


def _down(n: int) -> int:
    return n // ALIGN * ALIGN


def _up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class ReadStats:
    bytes: int
    seconds: float
    gbps: float  # 1e9 bytes per second
    direct: bool  # False: read through the page cache (the fallback)

    @classmethod
    def of(cls, nbytes: int, seconds: float, direct: bool) -> "ReadStats":
        return cls(nbytes, seconds, nbytes / seconds / 1e9 if seconds > 0 else 0.0, direct)


def fs_type(path) -> str:
    """The type of the filesystem holding `path` ("ext4", "tmpfs", ...), from /proc/self/mountinfo."""
    real = os.path.realpath(path)
    best, kind = "", "unknown"
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                point = left.split()[4].encode().decode("unicode_escape")  # \040 for spaces
                if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
                    best, kind = point, right.split()[0]
    except OSError:
        pass
    return kind


def _address(buf) -> int:
    """Address of the first byte of a writable buffer (a temporary export; nothing is kept)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def _pread_full(fd: int, view: memoryview, offset: int) -> int:
    """Read len(view) bytes at `offset`; fewer only at the end of the file."""
    got, want = 0, len(view)
    while got < want:
        n = os.preadv(fd, [view[got:]], offset + got)
        if n == 0:
            break
        got += n
    return got


class DirectReader:
    """One open file and a pool of reader threads. Thread-safe: calls may overlap."""

    def __init__(
        self,
        path,
        threads: int = 4,
        chunk_bytes: int = DEFAULT_CHUNK,
        direct: bool = True,
        warn: Callable[[str], None] | None = None,
    ):
        if type(threads) is not int or threads < 1:
            raise ValueError(f"threads must be an int >= 1, got {threads!r}")
        if type(chunk_bytes) is not int or chunk_bytes < ALIGN or chunk_bytes % ALIGN:
            raise ValueError(f"chunk_bytes must be a positive multiple of {ALIGN}, got {chunk_bytes!r}")
        self.path = os.fspath(path)
        self.threads, self.chunk_bytes = threads, chunk_bytes
        self.fallback_reason: str | None = None  # why a direct reader reads buffered
        self.fd = -1
        if direct:
            self.fd, self.fallback_reason = self._open_direct()
            if self.fallback_reason:
                (warn or log.warning)(self.fallback_reason)
        self.direct = self.fd >= 0
        if not self.direct:
            self.fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
            # no readahead: it would cache pages past each chunk that no DONTNEED of ours covers
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="dio")
        self._local = threading.local()
        self._bounces: list[mmap.mmap] = []
        self._lock = threading.Lock()

    def _open_direct(self) -> tuple[int, str | None]:
        """(fd opened with O_DIRECT, None), or (-1, the reason direct reads cannot work here)."""
        kind = fs_type(self.path)
        fallback = "reading through the page cache and dropping it after each chunk"
        if kind in MEMORY_FS:
            return -1, f"direct I/O is impossible on {kind} ({self.path} lives in memory already); {fallback}"
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            return -1, f"direct I/O is not supported on {kind} (EINVAL); {fallback}"
        # some filesystems accept the flag and refuse the reads: try one block
        probe = mmap.mmap(-1, ALIGN)
        try:
            os.preadv(fd, [probe], 0)
        except OSError as e:
            os.close(fd)
            if e.errno != errno.EINVAL:
                raise
            return -1, f"direct reads of {self.path} fail on {kind} (EINVAL); {fallback}"
        finally:
            probe.close()
        return fd, None

    def _bounce(self) -> memoryview:
        """This thread's bounce buffer: one chunk, page-aligned, faulted in only as far as used."""
        m = getattr(self._local, "buf", None)
        if m is None:
            m = self._local.buf = mmap.mmap(-1, self.chunk_bytes)
            with self._lock:
                self._bounces.append(m)
        return memoryview(m)

    @property
    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def read_into(
        self,
        offset: int,
        nbytes: int,
        dest,
        dest_offset: int = 0,
        beat: Callable[[], None] | None = None,
        beat_s: float = 0.5,
    ) -> ReadStats:
        """Read file bytes [offset, offset + nbytes) into `dest` from `dest_offset` on.

        `dest` is a writable buffer (memoryview, mmap, numpy array, bytearray) or an int address
        of at least dest_offset + nbytes bytes. Only those bytes of `dest` are written. While the
        chunks are read, `beat()` runs on the calling thread every `beat_s` seconds (an actor's
        heartbeat). Returns only once every thread has stopped writing into `dest`."""
        if type(offset) is not int or type(nbytes) is not int or offset < 0 or nbytes < 0:
            raise ValueError(f"offset and nbytes must be ints >= 0, got {offset!r}, {nbytes!r}")
        end, size = offset + nbytes, self.size
        if end > size:
            raise ValueError(f"cannot read bytes [{offset}, {end}) of {self.path}: the file has {size} bytes")
        if isinstance(dest, int):
            dest = (ctypes.c_char * (dest_offset + nbytes)).from_address(dest)
        mv = memoryview(dest).cast("B")
        if dest_offset < 0 or dest_offset + nbytes > len(mv):
            raise ValueError(
                f"a {nbytes}-byte read does not fit at offset {dest_offset} of a {len(mv)}-byte destination"
            )
        t0 = time.perf_counter()
        if nbytes == 0:
            return ReadStats.of(0, 0.0, self.direct)
        # dest index of file byte x is x + shift; zero-copy needs the file and memory phases to agree
        shift = dest_offset - offset
        in_phase = self.direct and (_address(mv) + shift) % ALIGN == 0
        C = self.chunk_bytes
        pieces = [(max(k, offset), min(k + C, end)) for k in range(offset // C * C, end, C)]
        pending = {self._pool.submit(self._read_piece, mv, shift, c0, c1, in_phase) for c0, c1 in pieces}
        try:
            while pending:
                done, pending = wait(pending, timeout=beat_s if beat else None, return_when=FIRST_EXCEPTION)
                failed = [f for f in done if f.exception() is not None]
                if failed:
                    raise failed[0].exception()
                if beat and pending:
                    beat()
        finally:
            if pending:  # a piece failed (or beat raised): running pieces still write into dest
                for f in pending:
                    f.cancel()
                wait(pending)
            mv.release()
        if not self.direct:  # a piece's drop can race a neighbour's read of a shared page
            os.posix_fadvise(self.fd, _down(offset), _up(end) - _down(offset), os.POSIX_FADV_DONTNEED)
        return ReadStats.of(nbytes, time.perf_counter() - t0, self.direct)

    def read_ranges(self, ranges, dest) -> ReadStats:
        """Many small reads at once (LLM in a flash's neuron bundles): `ranges` holds (file offset, bytes,
        dest offset) triples, each a whole number of 4 KiB blocks at 4 KiB-aligned offsets, read in any
        order with one read per range, `threads` of them in flight, straight into `dest` (page-aligned:
        an mmap, an arena slot, an aligned numpy array). Returns once every read has landed."""
        ranges = [(int(o), int(n), int(d)) for o, n, d in ranges]
        mv = memoryview(dest).cast("B")
        try:
            bad = next(
                ((o, n, d) for o, n, d in ranges if o % ALIGN or n % ALIGN or n <= 0 or d < 0 or d + n > len(mv)), None
            )
            if bad is not None:
                raise ValueError(f"read_ranges needs whole 4 KiB blocks inside the destination; got {bad}")
            if self.direct and ranges and _address(mv) % ALIGN:
                raise ValueError("read_ranges reads directly into its destination: give a page-aligned one")
            t0 = time.perf_counter()
            # each worker takes every `threads`-th range: one task per thread, not one per read
            parts = [ranges[k :: self.threads] for k in range(min(self.threads, len(ranges)))]
            futures = [self._pool.submit(self._read_list, mv, part) for part in parts]
            wait(futures)
            for f in futures:
                f.result()
        finally:
            mv.release()
        return ReadStats.of(sum(n for _, n, _ in ranges), time.perf_counter() - t0, self.direct)

    def _read_list(self, mv: memoryview, ranges) -> None:
        for off, n, d in ranges:
            self._check(_pread_full(self.fd, mv[d : d + n], off), n, off)
            if not self.direct:
                os.posix_fadvise(self.fd, off, n, os.POSIX_FADV_DONTNEED)

    def _read_piece(self, mv: memoryview, shift: int, c0: int, c1: int, in_phase: bool) -> None:
        """File bytes [c0, c1), within one grid chunk, into mv[c0 + shift : c1 + shift]."""
        fd = self.fd
        if not self.direct:
            got = _pread_full(fd, mv[c0 + shift : c1 + shift], c0)
            self._check(got, c1 - c0, c0)
            os.posix_fadvise(fd, _down(c0), _up(c1) - _down(c0), os.POSIX_FADV_DONTNEED)
            return
        edges = [(c0, c1)]
        if in_phase:
            i0, i1 = _up(c0), _down(c1)
            if i1 > i0:  # the aligned middle: straight into dest
                self._check(_pread_full(fd, mv[i0 + shift : i1 + shift], i0), i1 - i0, i0)
            edges = [(a, b) for a, b in ((c0, i0), (i1, c1)) if a < b] if i1 >= i0 else [(c0, c1)]
        for e0, e1 in edges:
            # the aligned blocks around [e0, e1): at most one grid chunk, since chunks start aligned
            a0, a1 = _down(e0), _up(e1)
            bounce = self._bounce()
            got = _pread_full(fd, bounce[: a1 - a0], a0)  # short at the end of the file
            self._check(got, e1 - a0, a0)
            mv[e0 + shift : e1 + shift] = bounce[e0 - a0 : e1 - a0]

    def _check(self, got: int, want: int, at: int) -> None:
        if got < want:
            raise CadenceError(
                f"{self.path} ended at byte {at + got} while reading up to byte {at + want}; "
                f"was it truncated while in use?"
            )

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        for m in self._bounces:
            m.close()
        self._bounces.clear()

    def __enter__(self) -> "DirectReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        mode = "direct" if self.direct else "buffered"
        return f"DirectReader({self.path!r}, {mode}, threads={self.threads}, chunk={self.chunk_bytes})"


# -- the page cache ------------------------------------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
_PAGE = os.sysconf("SC_PAGE_SIZE")


def _resident(fd: int) -> int:
    """Bytes of the open file that sit in the page cache now."""
    size = os.fstat(fd).st_size
    if size == 0:
        return 0
    with mmap.mmap(fd, size, prot=mmap.PROT_READ) as m:  # maps, faults nothing in
        addr = np.frombuffer(m, dtype=np.uint8).ctypes.data
        pages = -(-size // _PAGE)
        vec = (ctypes.c_ubyte * pages)()
        if _libc.mincore(ctypes.c_void_p(addr), size, vec) != 0:
            e = ctypes.get_errno()
            raise OSError(e, f"mincore failed: {os.strerror(e)}")
        flags = np.frombuffer(vec, dtype=np.uint8) & 1
        n = int(flags.sum()) * _PAGE
        if flags[-1]:
            n -= pages * _PAGE - size  # the last page is partly past the end
        del addr, flags
    return n


def cached_bytes(path) -> int:
    """How much of `path` is in the page cache (mincore; root or write access needed for the truth)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return _resident(fd)
    finally:
        os.close(fd)


def evict_page_cache(paths: Iterable) -> int:
    """Drop the cached pages of whole files; returns the bytes that left the cache. Dirty pages
    (written and not yet on disk) and pages another process has mapped stay."""
    evicted = 0
    for path in paths:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            before = _resident(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            evicted += max(before - _resident(fd), 0)
        finally:
            os.close(fd)
    return evicted
