"""Where cadence keeps models, weight stores, compiled kernels and traces."""
from __future__ import annotations

import os
from pathlib import Path


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
