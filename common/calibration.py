"""Measurements of this machine, each taken once in a child process and kept as JSON under
$CADENCE_HOME/calibration/<name>-<key>.json, the key naming what the figures depend on: the runtime's
footprint (scheduler/generation/footprint.py) and the forward costs (engine/costs.py).

A measurement is checked before it is kept (`cached(check=...)`): one taken while other work kept the CPU or the
disk busy (`machine_load`, sampled just before), or whose repeats disagree, serves the run that took it and is not
kept, so that one busy moment (a first run beside a download) does not price every later plan."""

from __future__ import annotations

import json
import os
import subprocess
import time
from typing import Callable, TypeVar

from common import paths
from common.errors import CadenceError

T = TypeVar("T")


QUIET_CPU, QUIET_DISK = 0.25, 0.20  # busy shares above which the machine is not quiet enough to measure on


def machine_load(seconds: float = 0.5) -> dict:
    """{"cpu": the share of all cores busy, "disk": the busiest disk's share of time busy} over the next `seconds`
    (/proc/stat, /proc/diskstats; zeros where they cannot be read)."""

    def cpu():
        f = [int(x) for x in open("/proc/stat").readline().split()[1:]]
        return sum(f), f[3] + f[4]  # total, idle + iowait

    def disks():
        out = {}
        for line in open("/proc/diskstats"):
            p = line.split()
            if len(p) > 12 and not p[2].startswith(("loop", "ram", "dm-")) and not p[2][-1].isdigit():
                out[p[2]] = int(p[12])  # ms spent doing I/O
        return out

    try:
        (t0, i0), d0 = cpu(), disks()
        time.sleep(seconds)
        (t1, i1), d1 = cpu(), disks()
    except (OSError, ValueError, IndexError):
        return {"cpu": 0.0, "disk": 0.0}
    busy = 1 - (i1 - i0) / max(1, t1 - t0)
    disk = max([(d1[k] - d0.get(k, d1[k])) / (1000 * seconds) for k in d1] or [0.0])
    return {"cpu": round(max(0.0, busy), 3), "disk": round(min(1.0, max(0.0, disk)), 3)}


def busy_reason(load: dict) -> str | None:
    """Why a measurement taken under `load` is not kept, or None (a quiet machine)."""
    if load.get("cpu", 0) > QUIET_CPU:
        return f"the CPU was {load['cpu']:.0%} busy with other work"
    if load.get("disk", 0) > QUIET_DISK:
        return f"the disk was {load['disk']:.0%} busy with other work"
    return None


def cached(
    name: str,
    key: str,
    measure: Callable[[], dict],
    make: Callable[[dict], T],
    check: Callable[[dict], str | None] | None = None,
    fresh: bool = False,
) -> T:
    """`make` of the figures kept for `key`, or of `measure()` now, then kept (written whole or not at all; a
    home that cannot be written measures again next time). A file `make` cannot read is measured again. `check`:
    why the figures just measured are not to be kept (a busy machine, repeats that disagree), or None. `fresh`:
    measured again whatever is kept (`launch calibrate`)."""
    path = paths.home() / "calibration" / f"{name}-{key}.json"
    try:
        if not fresh:
            return make(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    got = measure()
    out = make(got)
    if check is not None and check(got):
        return out
    try:
        keep(path, got)
    except OSError:
        pass
    return out


def keep(path: "os.PathLike", figures: dict) -> None:
    """`figures` written to `path` whole or not at all (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(figures))
    tmp.replace(path)


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
