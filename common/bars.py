"""The progress bars a command draws, on stderr (stdout is for results: the generated text, pulled paths): a
download's bytes, and a count of steps done (a conversion's tensors, an expert's bitwidths, a layer's bundles)."""

from __future__ import annotations

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)


def download_bar() -> Progress:
    """Bytes read of a download's size, their rate and the time left."""
    return Progress(
        TextColumn("{task.description:<48}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        transient=False,
        console=Console(stderr=True),
    )


def count_bar() -> Progress:
    """Steps done out of a count, and the time spent."""
    return Progress(
        TextColumn("{task.description:<40}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
    )
