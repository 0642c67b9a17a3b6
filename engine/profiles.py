"""ARCA profiles on disk: `launch profile --out` writes one, `launch run --profile` reads it back."""

from __future__ import annotations

import json
from pathlib import Path

from common.errors import CadenceError


def partition_name(share: float, cols: float) -> str:
    return f"worker:{share}" + (f",cols:{cols}" if cols else "")


def parse_partition(name: str) -> tuple[float, float]:
    """ "worker:S" or "worker:S,cols:C" -> (S, C): the worker's share of dense attention and of columns."""
    try:
        parts = dict(p.split(":") for p in name.split(","))
        return float(parts["worker"]), float(parts.get("cols", 0.0))
    except (ValueError, KeyError):
        raise CadenceError(
            f"the profile's partition {name!r} is not none, worker:S or worker:S,cols:C; "
            "make the profile again with `launch profile`"
        ) from None


def load_profile(path: str) -> dict:
    """A profile `launch profile --out` wrote: its width, partition and tree are checked here, so a wrong
    file ends in a sentence rather than deep in the run."""
    again = f"make one with `launch profile --out {path}`"
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise CadenceError(f"cannot read the profile {path} ({getattr(e, 'strerror', None) or e}); {again}") from None
    try:
        prof = json.loads(text)
    except json.JSONDecodeError as e:
        raise CadenceError(f"the profile {path} is not JSON ({e.msg} at line {e.lineno}); {again}") from None
    tree = prof.get("tree") if isinstance(prof, dict) else None
    if not (
        isinstance(prof, dict)
        and isinstance(prof.get("width"), int)
        and prof["width"] >= 0
        and isinstance(prof.get("partition"), str)
        and isinstance(tree, dict)
        and isinstance(tree.get("parents"), list)
        and isinstance(tree.get("ranks"), list)
    ):
        raise CadenceError(
            f"{path} is not a profile written by `launch profile` (it needs a width, a partition and a tree); {again}"
        )
    return prof
