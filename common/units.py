"""Memory sizes as people write them and as reports show them."""

from __future__ import annotations

import math
import os
import re

from common.errors import CadenceError

MiB = 1 << 20


def fmt(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / MiB:.0f} MiB"


def fmt_up(n: int) -> str:
    """`n` bytes as `fmt` shows them, rounded up: a budget named as the smallest that works works as typed (676.1 MiB
    shown as 676 MiB would be refused again in the same words)."""
    if n >= 2**30:
        return f"{math.ceil(n / 2**30 * 100 - 1e-9) / 100:.2f} GiB"
    return f"{math.ceil(n / MiB - 1e-9)} MiB"


# Units of a memory size, matched case-insensitively: binary (KiB, k, K) and decimal (KB) spellings.
_UNITS = {
    "": 1,
    "b": 1,
    **{u: 1 << 10 * i for i, p in enumerate("kmgt", 1) for u in (p, f"{p}ib")},
    **{f"{p}b": 10 ** (3 * i) for i, p in enumerate("kmgt", 1)},
}
_SIZE = re.compile(r"([0-9]*\.?[0-9]+(?:e[0-9]+)?)([a-z]*)")


def machine_memory() -> int:
    """This machine's physical memory in bytes (MemTotal)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def parse_bytes(text: str) -> int:
    """A memory budget's size: '3GiB', '2.5G', '800MiB', '1.5TB', '64k', '1000000000' -> bytes. Binary units
    (KiB/MiB/GiB/TiB, and K/M/G/T alone) count in 1024s, decimal ones (KB/MB/GB/TB) in 1000s, in any case.
    A size above this machine's memory is refused: no run can stay under it and use it."""
    m = _SIZE.fullmatch(text.strip().lower().replace(" ", "").replace("_", ""))
    if m is None or m.group(2) not in _UNITS:
        raise CadenceError(
            f"cannot read the memory size {text!r}; write it like 3GiB, 800MiB, 1.5TB or a number of bytes"
        )
    n = float(m.group(1)) * _UNITS[m.group(2)]  # a float: 1e400GiB is more than any machine, not an overflow
    if n > (have := machine_memory()):
        size = fmt(int(n)) if n < 1 << 62 else "beyond any machine"
        raise CadenceError(
            f"a memory budget of {text.strip()} ({size}) is more than this machine's memory "
            f"({fmt(have)}); give a smaller one, or leave --memory-budget out to run without a bound"
        )
    if int(n) <= 0:
        raise CadenceError(f"the memory size {text!r} is not above zero; give a budget like 3GiB, or auto")
    return int(n)
