"""Which build of cadence's CPU kernels (models/csrc) a process runs, and building it: one library per
instruction-set path (PATHS, each with its own -march flags), compiled once into $CADENCE_HOME/kernels
keyed by source, flags and compiler; the best path the CPU has, or the one `CADENCE_KERNEL_PATH` names.
No torch here: the scheduler and the cost calibration's key read it (models/kernels.py loads the library).
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from common import paths
from common.errors import CadenceError

CSRC = Path(__file__).parent / "csrc"
SOURCES = (
    "attention.cpp",
    "linear.cpp",
    "qlinear.cpp",
    "experts.cpp",
    "ops.cpp",
    "flash.cpp",
    "layer.cpp",
    "recurrent.cpp",
    "ssm_layer.cpp",
)
# no a * b + c contracted into an FMA unasked: every path then rounds the same way (csrc/vec.hpp)
FLAGS = ["-O3", "-fopenmp", "-fPIC", "-shared", "-std=gnu++17", "-fno-math-errno", "-ffp-contract=off"]
ENV_PATH = "CADENCE_KERNEL_PATH"


@dataclass(frozen=True)
class KernelPath:
    name: str
    flags: tuple[str, ...]  # compiler flags of its build
    needs: tuple[str, ...]  # CPU flags (/proc/cpuinfo) it runs on


_V3 = ("avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm")  # x86-64-v3
_V4 = _V3 + ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")  # x86-64-v4
_X86 = platform.machine() in ("x86_64", "AMD64")
# best first; "amx" also holds the avx512vnni path, which it runs where the kernel refuses tile state
PATHS = (
    (
        KernelPath(
            "amx",
            ("-march=x86-64-v4", "-mavx512vnni", "-mamx-tile", "-mamx-int8"),
            _V4 + ("avx512_vnni", "amx_tile", "amx_int8"),
        ),
        KernelPath("avx512vnni", ("-march=x86-64-v4", "-mavx512vnni"), _V4 + ("avx512_vnni",)),
        KernelPath("avxvnni", ("-march=x86-64-v3", "-mavxvnni"), _V3 + ("avx_vnni",)),
        KernelPath("avx2", ("-march=x86-64-v3",), _V3),
        KernelPath("portable", ("-march=x86-64",), ()),
    )
    if _X86
    else (KernelPath("portable", (), ()),)
)
BY_NAME = {p.name: p for p in PATHS}


@lru_cache(maxsize=1)
def _cpuinfo() -> dict[str, str]:
    """The first CPU's fields of /proc/cpuinfo (none where it cannot be read)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().split("\n\n", 1)[0].splitlines()
    except OSError:
        return {}
    return {k.strip(): v.strip() for k, _, v in (ln.partition(":") for ln in lines)}


def cpu_flags() -> frozenset[str]:
    info = _cpuinfo()
    return frozenset((info.get("flags") or info.get("Features") or "").split())


def cpu_model() -> str:
    return _cpuinfo().get("model name") or platform.processor() or "unknown CPU"


@lru_cache(maxsize=1)
def sources_digest() -> str:
    """The kernels' sources (models/csrc), hashed: what a build and a measurement of them depend on."""
    h = hashlib.sha256()
    for f in sorted(CSRC.iterdir()):
        h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()


@lru_cache(maxsize=1)
def numerics_digest() -> str:
    """What a forward's numbers depend on besides the weights and the kernel path: the kernels' sources and the
    math's Python (models/), hashed. What outlives a run (the prompt cache's rows on disk) is keyed by it, so a
    cadence whose math changed computes them afresh rather than reading rows another one wrote."""
    h = hashlib.sha256(sources_digest().encode())
    for f in sorted(CSRC.parent.rglob("*.py")):
        h.update(str(f.relative_to(CSRC.parent)).encode() + f.read_bytes())
    return h.hexdigest()


def host_paths() -> list[str]:
    """The paths this CPU can run, best first."""
    have = cpu_flags()
    return [p.name for p in PATHS if set(p.needs) <= have]


def chosen_path() -> str:
    """The path this process runs: $CADENCE_KERNEL_PATH, else the best the CPU has."""
    want = os.environ.get(ENV_PATH, "").strip()
    here = host_paths()
    if not want:
        return here[0]
    if want not in BY_NAME:
        raise CadenceError(f"{ENV_PATH}={want} is not a kernel path; choose one of {', '.join(BY_NAME)}")
    if want not in here:
        lacks = sorted(set(BY_NAME[want].needs) - cpu_flags())
        raise CadenceError(
            f"{ENV_PATH}={want} needs the CPU flags {', '.join(lacks)}, which this CPU lacks; it runs {', '.join(here)}"
        )
    return want


def build(path: str, defines: tuple[str, ...] = ()) -> Path:
    """The library of one path (built if missing); `defines`: extra -D flags (tests)."""
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise CadenceError(
            "no C++ compiler found to build cadence's CPU kernels: install g++ (Debian: apt-get install g++)"
        )
    flags = [*FLAGS, *BY_NAME[path].flags, *defines]
    h = hashlib.sha256(sources_digest().encode())
    h.update(" ".join(flags).encode() + cxx.encode())
    out = paths.kernels_dir() / f"libcadence-{path}-{h.hexdigest()[:16]}.so"
    if out.exists():
        return out
    paths.writable_dir(out.parent)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_out = Path(tmp) / out.name
        cmd = [cxx, *flags, *(str(CSRC / s) for s in SOURCES), "-o", str(tmp_out)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            first = next((ln for ln in proc.stderr.splitlines() if "error" in ln), proc.stderr.strip()[:300])
            raise CadenceError(
                f"building cadence's CPU kernels for {path} failed ({first}); "
                "check that g++ (12 or newer) supports C++17 and -march=x86-64-v4"
            )
        os.replace(tmp_out, out)
    return out
