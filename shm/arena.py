"""Shared-memory arenas: one /dev/shm segment each, created and unlinked only by the scheduler.

A segment is named `cadence-<run_id>-<tag>`, and `run_id` is `<scheduler pid>x<random hex>`,
so `sweep_dead_segments` can tell the leftovers of a dead run from a live run's segments.
We open, size and map the file directly instead of using `multiprocessing.shared_memory`,
whose resource tracker unlinks segments (and warns) behind our back.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
import shutil

import psutil

from common.errors import CadenceError

SHM_DIR = "/dev/shm"
PREFIX = "cadence-"
ALIGN = 4096  # the I/O loader reads into slots with O_DIRECT

_RUN_ID = re.compile(r"(\d+)x[0-9a-f]+\Z")
_TAG = re.compile(r"[a-z0-9_]+\Z")
SEGMENT_NAME = re.compile(r"cadence-((\d+)x[0-9a-f]+)-[a-z0-9_]+\Z")  # a segment of ours: cadence-<run id>-<tag>


def new_run_id() -> str:
    """`<pid>x<6 hex>`: the pid lets a later run tell whether this one is still alive."""
    return f"{os.getpid()}x{secrets.token_hex(3)}"


def segment_name(run_id: str, tag: str) -> str:
    if not _RUN_ID.match(run_id):
        raise ValueError(f"run_id must look like '<pid>x<hex>', got {run_id!r}")
    if not _TAG.match(tag):
        raise ValueError(f"arena tag must be lowercase letters, digits or '_', got {tag!r}")
    return f"{PREFIX}{run_id}-{tag}"


def run_segments(run_id: str, shm_dir: str = SHM_DIR) -> list[str]:
    """Names of the segments of `run_id` that exist now."""
    return sorted(n for n in os.listdir(shm_dir) if n.startswith(f"{PREFIX}{run_id}-"))


def _align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


def _fmt(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


class Arena:
    """One mapped segment. `buf` is a writable memoryview over all of it."""

    def __init__(self, name: str, mm: mmap.mmap, owner: bool):
        self.name = name
        self.nbytes = len(mm)
        self.owner = owner
        self._mm = mm
        self.buf = memoryview(mm)

    @classmethod
    def create(cls, run_id: str, tag: str, nbytes: int, shm_dir: str = SHM_DIR) -> "Arena":
        """The scheduler's process only. Reserves the pages now, so a full /dev/shm fails here, not with SIGBUS later."""
        if nbytes <= 0:
            raise ValueError(f"arena size must be > 0, got {nbytes}")
        nbytes = _align_up(nbytes)
        name = segment_name(run_id, tag)
        path = os.path.join(shm_dir, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as e:
                free = shutil.disk_usage(shm_dir).free
                raise CadenceError(
                    f"cannot reserve {_fmt(nbytes)} of shared memory for arena '{tag}' in {shm_dir} "
                    f"({_fmt(free)} free, {e.strerror}); lower memory.arena_bytes or free {shm_dir}"
                ) from None
            mm = mmap.mmap(fd, nbytes)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        return cls(name, mm, owner=True)

    @classmethod
    def attach(cls, name: str, shm_dir: str = SHM_DIR) -> "Arena":
        """Actors: map an existing segment. The scheduler keeps ownership."""
        if not SEGMENT_NAME.match(name):
            raise ValueError(f"not a cadence segment name: {name!r}")
        try:
            fd = os.open(os.path.join(shm_dir, name), os.O_RDWR)
        except FileNotFoundError:
            raise CadenceError(f"shared-memory segment {name} does not exist; was its scheduler stopped?") from None
        try:
            mm = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        return cls(name, mm, owner=False)

    def close(self) -> None:
        """Drop our references. The mapping itself goes with the last tensor view of it: torch
        views keep the buffer object alive but hold no export, so an explicit munmap here
        could pull memory from under a live tensor."""
        self.buf = None
        self._mm = None

    def unlink(self, shm_dir: str = SHM_DIR) -> None:
        if not self.owner:
            raise RuntimeError(f"only the scheduler unlinks {self.name}")
        try:
            os.unlink(os.path.join(shm_dir, self.name))
        except FileNotFoundError:
            pass

    def __repr__(self) -> str:
        return f"Arena({self.name!r}, {_fmt(self.nbytes)})"


def _run_is_dead(pid: int, created: float) -> bool:
    try:
        proc = psutil.Process(pid)
        # a process that started after the segment was created only reuses the pid
        return proc.create_time() > created + 1.0
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return False  # cannot tell: leave it


def sweep_dead_segments(shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink the segments of runs whose scheduler is gone. Returns the names removed."""
    return sweep_dead(shm_dir, SEGMENT_NAME, 2)


def sweep_dead(folder, pattern: re.Pattern, pid_group: int) -> list[str]:
    """Unlink the files in `folder` that `pattern` names (its group `pid_group`: the run's pid) of runs whose
    scheduler is gone: a run killed outright leaves its segments, and a trace's spill file, behind. Returns the
    names removed."""
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []  # a folder this user cannot read: nothing of its runs' to sweep
    removed = []
    for name in names:
        m = pattern.match(name)
        if not m:
            continue
        path = os.path.join(folder, name)
        try:
            created = os.stat(path).st_ctime
        except FileNotFoundError:
            continue
        if _run_is_dead(int(m.group(pid_group)), created):
            try:
                os.unlink(path)
                removed.append(name)
            except (FileNotFoundError, PermissionError):
                pass
    return removed
