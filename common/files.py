"""Reading the files a model comes in: a file that is not what it claims to be ends in one sentence that
names it (a device given as a model, a config.json that is not JSON, a full disk under a weight store)."""

from __future__ import annotations

import errno
import json
import stat
from pathlib import Path

from common import paths
from common.errors import CadenceError

_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a named pipe (FIFO)"),
    (stat.S_ISSOCK, "a socket"),
)


def what_is(path: Path) -> str:
    """What `path` is, for a sentence about a path that should be a regular file: "does not exist",
    "is a character device, not a file" (/dev/zero), "is a folder, not a file"."""
    try:
        mode = Path(path).stat().st_mode
    except FileNotFoundError:
        return "does not exist"
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    kind = next((what for test, what in _KINDS if test(mode)), "not a regular file")
    return f"is {kind}, not a file"


def read_bytes(path: Path, advice: str) -> bytes:
    """The bytes of a regular file; one sentence naming it, ending in `advice`, where it cannot be read."""
    path = Path(path)
    if not path.is_file():  # a device or a pipe would be read forever
        raise CadenceError(f"{path} {what_is(path)}; {advice}")
    try:
        return path.read_bytes()
    except OSError as e:
        raise CadenceError(f"cannot read {path} ({e.strerror or e}); {advice}") from None


def read_text(path: Path, advice: str) -> str:
    """A regular file's UTF-8 text (see `read_bytes`)."""
    data = read_bytes(path, advice)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CadenceError(f"{path} is not UTF-8 text (byte {e.start} is 0x{data[e.start]:02x}); {advice}") from None


def read_json(path: Path, advice: str) -> dict:
    """A regular file holding one JSON object (see `read_bytes`)."""
    text = read_text(path, advice)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise CadenceError(f"{path} is not valid JSON ({e.msg}, line {e.lineno} column {e.colno}); {advice}") from None
    except RecursionError:
        raise CadenceError(f"{path} nests its JSON too deeply to be read; {advice}") from None
    if not isinstance(value, dict):
        raise CadenceError(f"{path} holds a JSON {type(value).__name__}, not an object; {advice}")
    return value


def no_space(e: OSError, path: Path) -> CadenceError | None:
    """The sentence for a write to `path` that failed for want of room (a full disk, a quota); None for any
    other failure."""
    if e.errno not in (errno.ENOSPC, errno.EDQUOT):
        return None
    return CadenceError(
        f"no space left for {path} ({e.strerror}); free some space on its disk, or point CADENCE_HOME "
        f"(now {paths.home()}) at a disk with room"
    )
