"""Measurements of this machine, each taken once in a child process and kept as JSON under
$CADENCE_HOME/calibration/<name>-<key>.json, the key naming what the figures depend on: the runtime's
footprint (scheduler/generation/footprint.py) and the forward costs (engine/costs.py)."""

from __future__ import annotations

import json
import os
import subprocess
from typing import Callable, TypeVar

from common import paths
from common.errors import CadenceError

T = TypeVar("T")


def cached(name: str, key: str, measure: Callable[[], dict], make: Callable[[dict], T]) -> T:
    """`make` of the figures kept for `key`, or of `measure()` now, then kept (written whole or not at all; a
    home that cannot be written measures again next time). A file `make` cannot read is measured again."""
    path = paths.home() / "calibration" / f"{name}-{key}.json"
    try:
        return make(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    got = measure()
    out = make(got)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(got))
        tmp.replace(path)
    except OSError:
        pass
    return out


def child_json(cmd: list[str], what: str, advice: str = "", env: dict | None = None, timeout_s: int = 600) -> dict:
    """The JSON object a measuring child prints on its last line; where it fails, one sentence: `what` failed
    (the child's last error line), then `advice`."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise CadenceError(f"{what} took over {timeout_s // 60} minutes{advice}") from None
    try:
        got = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        got = None
    if not isinstance(got, dict):
        err = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise CadenceError(f"{what} failed ({err}){advice}")
    return got
