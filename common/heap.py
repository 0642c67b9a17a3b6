"""Give freed heap back to the kernel: memory that counts against a budget until it is returned.

glibc keeps freed blocks in its arenas. Parsing a 5 MB tokenizer JSON leaves ~90 MiB of them in
the scheduler, and loading a model leaves some in an actor; under a memory cgroup they count as
much as live data. `malloc_trim(0)` returns every free page at the top and inside the arenas.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from functools import lru_cache


@lru_cache(maxsize=1)
def _libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:  # not glibc: nothing to trim with
        return None


def trim_heap() -> None:
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


M_ARENA_MAX = -8  # mallopt's parameter (malloc.h)


@lru_cache(maxsize=1)
def one_arena() -> None:
    """Every thread of this process allocates from the main arena (glibc gives each new thread an arena of its own,
    whose freed blocks it keeps: a few threads growing draft trees together held tens of MiB more, enough for a
    memory cgroup to kill the process). Once per process, before its threads start."""
    libc = _libc()
    if libc is not None and hasattr(libc, "mallopt"):
        libc.mallopt(M_ARENA_MAX, 1)
