"""Timing and the machine a benchmark ran on, for `launch bench` and `launch profile`."""

from __future__ import annotations

import os

RTT_S = 3e-4  # one control round trip between the scheduler and an actor (launch runtime-bench)


def machine() -> str:
    """The CPU, its cores and vector flags, and the torch version: one line for a report."""
    from models.kernel_build import cpu_flags, cpu_model

    try:
        import importlib.metadata as md

        torch_version = md.version("torch")
    except Exception:  # noqa: BLE001 - a figure for the report only
        torch_version = "?"
    have, model = cpu_flags(), cpu_model()
    flags = " ".join(
        f
        for f in ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_int8")
        if f in have
    )
    return f"{model}, {os.cpu_count()} cores, {flags}, torch {torch_version}"
