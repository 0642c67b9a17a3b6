"""Timing and the machine a benchmark ran on, for `launch bench` and `launch profile`."""

from __future__ import annotations

import os
import platform
from pathlib import Path

RTT_S = 3e-4  # one control round trip between the scheduler and an actor (launch runtime-bench)


def machine() -> str:
    """The CPU, its cores and vector flags, and the torch version: one line for a report."""
    try:
        model = next(
            ln.split(":", 1)[1].strip()
            for ln in Path("/proc/cpuinfo").read_text().splitlines()
            if ln.startswith("model name")
        )
    except (OSError, StopIteration):
        model = platform.processor()
    try:
        import importlib.metadata as md

        torch_version = md.version("torch")
    except Exception:  # noqa: BLE001 - a figure for the report only
        torch_version = "?"
    flags = ""
    try:
        line = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags"))
        have = set(line.split(":", 1)[1].split())
        flags = " ".join(
            f for f in ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16") if f in have
        )
    except (OSError, StopIteration):
        pass
    return f"{model}, {os.cpu_count()} cores, {flags}, torch {torch_version}"
