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
