"""Memory cgroups: run a command under a hard memory limit and measure its peak, page cache included.

A child cgroup of this process's own memory cgroup gets the limit, so everything the command
touches is charged to it: its anonymous memory, the shared-memory arena it creates, kernel memory,
and the page cache of files it reads (the kernel reclaims that cache to stay under the limit, so a
model larger than the limit cannot sit in memory). Pages cached *before* the command ran, by anyone,
are charged elsewhere: `run_in_cgroup` evicts the model files first. cgroup v1 (memory hierarchy)
and v2 (unified, `memory` controller) both work; creating a cgroup needs root.

    with MemoryCgroup(512 << 20) as cg:        # a child of our own memory cgroup, limit set
        cg.add(pid); ...; cg.peak_bytes()       # removed on exit, whatever happens
    run = run_in_cgroup(argv, 512 << 20, evict=[weights])   # the child starts inside the cgroup

The cgroup's own peak counts the page cache, which fills any limit and is reclaimed, so it says
little about what a run needs. What its processes hold, anonymous plus shared memory
(`held_bytes`, from memory.stat), is sampled beside it: its peak, and each process's share of it
(PSS, by process name: the actors name themselves `cadence-<role>`) near that peak.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from bench.cgroup_detect import AGAIN as _AGAIN, CgroupInfo, detect
from common.errors import CadenceError
from scheduler.ledger import rollup
from shm.dio import cached_bytes, evict_page_cache


def _read_int(path: Path) -> int:
    v = path.read_text().strip()
    return 2**63 - 1 if v == "max" else int(v)


def _keyed(path: Path) -> dict[str, int]:
    """A flat-keyed file ("oom_kill 3" lines) as a dict."""
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return {}
    return {k: int(v) for k, _, v in (ln.partition(" ") for ln in lines) if v.strip().lstrip("-").isdigit()}


def _write(path: Path, value) -> None:
    with open(path, "w") as f:
        f.write(str(value))


class MemoryCgroup:
    """A child memory cgroup with a limit, removed on exit. Pass `info` to skip detection."""

    def __init__(
        self, limit_bytes: int, name: str | None = None, info: CgroupInfo | None = None, sample_s: float = 0.02
    ):
        if type(limit_bytes) is not int or limit_bytes <= 0:
            raise ValueError(f"limit_bytes must be an int > 0, got {limit_bytes!r}")
        self.limit = limit_bytes
        self.name = name or f"cadence-{os.getpid()}-{secrets.token_hex(3)}"
        self.info = info
        self.sample_s = sample_s
        self.dir: Path | None = None
        self._peak = 0
        self.peak_held = 0  # anonymous + shared memory, sampled
        self.held_by_process: dict[str, int] = {}  # process name -> PSS (anon + shmem) near the held peak
        self._stop = threading.Event()
        self._sampler: threading.Thread | None = None

    @property
    def version(self) -> int:
        return self.info.version

    def __enter__(self) -> "MemoryCgroup":
        self.info = self.info or detect()
        parent = self.info.own_dir
        if self.version == 2:
            self._enable_memory(parent)
        self.dir = parent / self.name
        sweep(parent)
        try:
            self.dir.mkdir()
        except OSError as e:
            raise CadenceError(f"cannot create the cgroup {self.dir}: {e.strerror}; {_AGAIN}") from None
        try:
            if self.version == 1:
                _write(self.dir / "memory.limit_in_bytes", self.limit)
                if (self.dir / "memory.memsw.limit_in_bytes").exists():  # memory + swap: no escape to swap
                    _write(self.dir / "memory.memsw.limit_in_bytes", self.limit)
            else:
                _write(self.dir / "memory.max", self.limit)
                if (self.dir / "memory.swap.max").exists():
                    _write(self.dir / "memory.swap.max", 0)
            self._sampler = threading.Thread(target=self._sample, name="cgroup-peak", daemon=True)
            self._sampler.start()
        except BaseException:
            self.close()
            raise
        return self

    def _enable_memory(self, parent: Path) -> None:
        ctl = parent / "cgroup.subtree_control"
        if "memory" in ctl.read_text().split():
            return
        try:
            _write(ctl, "+memory")
        except OSError as e:
            raise CadenceError(
                f"cannot enable the memory controller for children of {parent} ({e.strerror}); cgroup v2 refuses "
                f"it in a cgroup that holds processes itself: start cadence in a leaf cgroup whose parent "
                f"delegates memory (e.g. systemd-run --scope -p Delegate=yes) or {_AGAIN}"
            ) from None

    def __exit__(self, *exc) -> None:
        self.close()

    def _file(self, v1: str, v2: str) -> Path:
        return self.dir / (v1 if self.version == 1 else v2)

    def add(self, pid: int) -> None:
        """Move process `pid` (all its threads) into the cgroup; its new pages are charged here."""
        _write(self.dir / "cgroup.procs", pid)

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in (self.dir / "cgroup.procs").read_text().split()]
        except FileNotFoundError:
            return []

    def usage_bytes(self) -> int:
        return _read_int(self._file("memory.usage_in_bytes", "memory.current"))

    def peak_bytes(self) -> int:
        """The most the cgroup held at once since it was created (v2 without memory.peak: sampled)."""
        if self.version == 1:
            return _read_int(self.dir / "memory.max_usage_in_bytes")
        if (self.dir / "memory.peak").exists():
            return _read_int(self.dir / "memory.peak")
        return max(self._peak, self.usage_bytes())

    def oom_kills(self) -> int:
        """Processes the kernel's OOM killer killed in this cgroup for being over the limit."""
        if self.version == 2:
            return _keyed(self.dir / "memory.events").get("oom_kill", 0)
        ctl = _keyed(self.dir / "memory.oom_control")
        if "oom_kill" in ctl:
            return ctl["oom_kill"]
        return int(_read_int(self.dir / "memory.failcnt") > 0 and ctl.get("under_oom", 0) > 0)  # kernels < 4.13

    def held_bytes(self) -> int:
        """Anonymous + shared memory of the cgroup's processes now (the page cache aside)."""
        st = _keyed(self.dir / "memory.stat")
        if self.version == 1:
            return st.get("total_rss", st.get("rss", 0)) + st.get("total_shmem", st.get("shmem", 0))
        return st.get("anon", 0) + st.get("shmem", 0)

    def _by_process(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for pid in self.pids():
            try:
                name = Path(f"/proc/{pid}/comm").read_text().strip()
            except OSError:
                continue
            if not (roll := rollup(pid)):  # gone since
                continue
            out[name] = out.get(name, 0) + roll.get("Pss_Anon", 0) + roll.get("Pss_Shmem", 0)
        return out

    def _sample(self) -> None:
        last_procs = 0.0
        while not self._stop.wait(self.sample_s):
            try:
                if self.version == 2 and not (self.dir / "memory.peak").exists():
                    self._peak = max(self._peak, self.usage_bytes())
                held = self.held_bytes()
                if held > self.peak_held:
                    self.peak_held = held
                # each process's share near the peak (reading smaps costs the kernel a walk: twice a second)
                now = time.monotonic()
                if held >= 0.98 * self.peak_held and now - last_procs > 0.5:
                    last_procs = now
                    procs = self._by_process()
                    if sum(procs.values()) >= 0.9 * held:  # not torn by a process exiting in between
                        self.held_by_process = procs
            except ValueError:
                continue  # a torn read (a file being rewritten): the next sample will do
            except OSError:
                return  # the cgroup is gone

    def kill_all(self, timeout: float = 5.0) -> None:
        """SIGKILL every process in the cgroup but the runs' watchdogs (shm/watchdog.py: once the process that started
        one is gone, it removes that run's shared memory and exits; killed with the rest, the segments would stay),
        give those `timeout` to finish, then SIGKILL whatever is left and wait until the cgroup is empty."""
        from shm.watchdog import PROCESS_NAME

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rest = [pid for pid in self.pids() if _name(pid) != PROCESS_NAME]
            if not rest:
                break
            for pid in rest:
                _kill(pid)
            time.sleep(0.01)
        while self.pids() and time.monotonic() < deadline:  # the watchdogs, cleaning up
            time.sleep(0.02)
        kill = self.dir / "cgroup.kill"  # v2, Linux 5.14+
        deadline = time.monotonic() + timeout
        while self.pids() and time.monotonic() < deadline:
            if kill.exists():
                _write(kill, 1)
            else:
                for pid in self.pids():
                    _kill(pid)
            time.sleep(0.01)

    def close(self) -> None:
        """Move what is left back to our own cgroup, then remove this one (retrying while the kernel
        finishes with exiting processes)."""
        self._stop.set()
        if self._sampler is not None:
            self._sampler.join(1.0)
        if self.dir is None or not self.dir.exists():
            return
        parent = self.info.own_dir / "cgroup.procs"
        deadline = time.monotonic() + 5.0
        while True:
            for pid in self.pids():
                try:
                    _write(parent, pid)
                except ProcessLookupError:
                    pass
                except OSError:
                    pass  # exiting: gone by the next round
            try:
                self.dir.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError as e:
                if time.monotonic() > deadline:
                    raise CadenceError(
                        f"could not remove the cgroup {self.dir} ({e.strerror}); "
                        f"remove it by hand with rmdir once its processes have exited"
                    ) from None
                time.sleep(0.02)


def sweep(parent: Path) -> None:
    """Remove the cgroups under `parent` that a run killed before it could remove its own left behind (SIGKILL, or a
    signal its process had no handler for): `cadence-PID-...` whose process PID is gone and which hold no process.
    One that holds a process, or whose PID lives (maybe reused), stays."""
    for d in parent.glob("cadence-*-*"):
        try:
            pid = int(d.name.split("-")[1])
        except ValueError:
            continue
        if pid == os.getpid() or _alive(pid):
            continue
        try:
            if (d / "cgroup.procs").read_text().split():
                continue
            d.rmdir()
        except OSError:
            pass  # gone meanwhile, or not ours to remove


def _name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        pass
    return True


@dataclass(frozen=True)
class CgroupRun:
    returncode: int
    peak_bytes: int
    oom_killed: bool
    stdout: str | None  # None when not captured
    stderr: str | None
    wall_s: float
    limit_bytes: int = 0
    evicted_bytes: int = 0  # page cache dropped from the `evict` files before the start
    still_cached_bytes: int = 0  # what eviction could not drop (mapped by another process, dirty): not charged here
    timed_out: bool = False
    peak_held_bytes: int = 0  # anonymous + shared memory at its peak (what the processes hold, page cache aside)
    held_by_process: dict = None  # process name -> its share (PSS) of that, near the peak


def run_in_cgroup(
    argv: list[str],
    limit_bytes: int,
    evict=(),
    env: dict | None = None,
    timeout: float | None = None,
    cwd=None,
    capture: bool = True,
    info: CgroupInfo | None = None,
) -> CgroupRun:
    """Run `argv` inside a new memory cgroup of `limit_bytes`: evict the `evict` files' page
    cache, start the child already inside (it joins before exec, so nothing runs outside the limit),
    wait, and report its peak. Whatever is left in the cgroup at the end is killed."""
    with MemoryCgroup(limit_bytes, info=info) as cg:
        evict = list(evict)
        evicted = evict_page_cache(evict)
        still = sum(cached_bytes(p) for p in evict)
        fd = os.open(cg.dir / "cgroup.procs", os.O_WRONLY | os.O_CLOEXEC)
        pipe = subprocess.PIPE if capture else None
        t0 = time.monotonic()
        try:
            proc = subprocess.Popen(
                argv,
                stdout=pipe,
                stderr=pipe,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=cwd,
                preexec_fn=lambda: os.write(fd, str(os.getpid()).encode()),
            )
        except subprocess.SubprocessError as e:
            raise CadenceError(f"could not start {argv[0]} inside the cgroup {cg.dir}: {e}") from None
        finally:
            os.close(fd)
        timed_out = False
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            cg.kill_all()
            out, err = proc.communicate()
        except BaseException:
            cg.kill_all()
            proc.wait()
            raise
        wall = time.monotonic() - t0
        cg.kill_all()  # what the command left running (its own children)
        text = (lambda b: b.decode(errors="replace")) if capture else (lambda b: None)
        return CgroupRun(
            proc.returncode,
            cg.peak_bytes(),
            cg.oom_kills() > 0,
            text(out),
            text(err),
            wall,
            limit_bytes,
            evicted,
            still,
            timed_out,
            cg.peak_held,
            dict(cg.held_by_process),
        )
