"""Where this process's memory cgroup is, and which version (bench/cgroup.py makes its children there): read from
/proc/self/cgroup and mountinfo, with a sentence saying what is missing where there is none to use."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from common.errors import CadenceError

AGAIN = "drop --cgroup to run without the proof"


@dataclass(frozen=True)
class CgroupInfo:
    version: int  # 1 or 2
    memory_root: Path  # where the memory hierarchy is mounted (v2: the unified mount)
    own_path: str  # this process's cgroup in that hierarchy, e.g. "/process_api/<id>"
    mount_root: str = "/"  # the part of the hierarchy the mount shows (a cgroup namespace's root)

    @property
    def own_dir(self) -> Path:
        rel = os.path.relpath(self.own_path, self.mount_root)
        return self.memory_root if rel == "." or rel.startswith("..") else self.memory_root / rel


def _mounts(root: Path) -> list[tuple[str, str, str, set]]:
    """(mount root, mount point, fs type, super options) of each mount in mountinfo."""
    out = []
    for line in (root / "proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        f, r = left.split(), right.split()
        if len(f) >= 5 and len(r) >= 3:
            out.append((f[3], f[4].encode().decode("unicode_escape"), r[0], set(r[2].split(","))))
    return out


def detect(root: str | os.PathLike = "/") -> CgroupInfo:
    """Where this process's memory cgroup is and which version it is; CadenceError saying what is
    missing otherwise. `root` stands in for / in tests (a fake /proc and /sys tree)."""
    root = Path(root)
    if os.geteuid() != 0:
        raise CadenceError(
            f"--cgroup needs root to create a memory cgroup (running as uid {os.geteuid()}); rerun as root or {AGAIN}"
        )
    own = {}  # controller set -> path; v2's line has an empty controller list
    for line in (root / "proc/self/cgroup").read_text().splitlines():
        _, ctrl, path = line.split(":", 2)
        own[ctrl] = path
    mounts = _mounts(root)
    info = None
    for mroot, point, fstype, opts in mounts:
        if fstype == "cgroup" and "memory" in opts:
            path = next((p for c, p in own.items() if "memory" in c.split(",")), None)
            if path is not None:
                info = CgroupInfo(1, root / point.lstrip("/"), path, mroot)
                break
    if info is None and "" in own:
        for mroot, point, fstype, opts in mounts:
            if fstype == "cgroup2":
                cand = CgroupInfo(2, root / point.lstrip("/"), own[""], mroot)
                ctrls = cand.own_dir / "cgroup.controllers"
                if ctrls.exists() and "memory" in ctrls.read_text().split():
                    info = cand
                break
    if info is None:
        raise CadenceError(
            "no memory cgroup controller is available to this process (neither a cgroup v1 'memory' "
            "hierarchy nor 'memory' in the cgroup v2 cgroup.controllers); enable the memory "
            f"controller (or delegate it to this cgroup) or {AGAIN}"
        )
    d = info.own_dir
    if not d.is_dir() or not os.access(d, os.W_OK):
        raise CadenceError(
            f"cannot create a cgroup in {d} (cgroup v{info.version}): it is missing or not writable "
            f"(read-only cgroupfs in a container?); mount it read-write or {AGAIN}"
        )
    return info
