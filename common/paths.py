"""Where cadence keeps models, weight stores, compiled kernels and traces."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from common.errors import CadenceError


def home() -> Path:
    """$CADENCE_HOME, default ~/.cache/cadence."""
    return Path(os.environ.get("CADENCE_HOME") or Path.home() / ".cache" / "cadence")


def models_dir() -> Path:
    return home() / "models"


def stores_dir() -> Path:
    return home() / "stores"


def kernels_dir() -> Path:
    """Compiled CPU kernels; $CADENCE_KERNELS_DIR overrides (tests share one build across homes)."""
    return Path(os.environ.get("CADENCE_KERNELS_DIR") or home() / "kernels")


def writable_dir(folder: Path) -> Path:
    """`folder`, created if missing, once a file could be made in it: a folder under $CADENCE_HOME that
    cannot be written ends in one sentence before any work whose result would go there."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tempfile.NamedTemporaryFile(dir=folder, prefix=".cadence-probe-").close()
    except OSError as e:
        raise CadenceError(
            f"cannot write to {folder} ({e.strerror or e}); make CADENCE_HOME ({home()}) a folder you "
            "can write to, or point CADENCE_HOME at one"
        ) from None
    return folder


def check_output(path: str | Path, option: str) -> Path:
    """An output file's path, checked before a long run: its folder must exist (or be creatable) and take a
    new file, so results are not computed and then lost."""
    path = Path(path)
    if path.is_dir():
        raise CadenceError(f"{option} {path} is a folder; give a file path, e.g. {path / 'out.json'}")
    folder = path.parent
    while (
        not folder.exists() and folder != folder.parent
    ):  # write_rows creates missing folders: check the first existing one
        folder = folder.parent
    try:
        if not folder.is_dir():
            raise NotADirectoryError(0, "not a folder")
        tempfile.NamedTemporaryFile(dir=folder, prefix=".cadence-probe-").close()
    except OSError as e:
        raise CadenceError(
            f"{option} {path} cannot be written ({folder}: {e.strerror or e}); give a path in a folder you can write to"
        ) from None
    return path
