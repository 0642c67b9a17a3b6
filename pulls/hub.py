"""`launch models pull hf:OWNER/REPO[:FILE]`: a model from the Hugging Face hub, for users who have the internet.

`hf:OWNER/REPO:FILE` is one `.gguf` file of the repository; `hf:OWNER/REPO` its HF model directory (config.json,
tokenizer.json, tokenizer_config.json and generation_config.json where present, *.safetensors and their index).
They land under `$CADENCE_HOME/models/hf/OWNER/REPO/`, each file only once its bytes match what the hub says
(the sha256 of its LFS metadata, or a small file's git blob id: pulls/hub_fetch.py). `.cadence-pull.json` there
records what was verified, so a name resolves (`--target hf:...`) without the network once pulled. A download
stopped midway (a dropped connection, Ctrl-C) is kept in `models/hf/.partial/` and continues where it stopped on
the next pull.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from common import paths
from common.errors import CadenceError

PREFIX = "hf:"
MANIFEST = ".cadence-pull.json"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
DIRECTORY_FILES = ("config.json", "tokenizer.json")  # and at least one *.safetensors
OPTIONAL_FILES = ("tokenizer_config.json", "generation_config.json")


@dataclass(frozen=True)
class HubRef:
    repo: str  # OWNER/REPO
    file: str | None  # a .gguf file in it, or None: the HF model directory

    @property
    def name(self) -> str:
        return f"{PREFIX}{self.repo}" + (f":{self.file}" if self.file else "")

    @property
    def label(self) -> str:
        """The name a weight store converted from it starts with."""
        return Path(self.file).stem if self.file else self.repo.split("/")[1]


def is_ref(name: str) -> bool:
    return isinstance(name, str) and name.startswith(PREFIX)


def parse(name: str) -> HubRef:
    """`hf:OWNER/REPO[:FILE]`, checked; one sentence where it is not one."""
    repo, _, file = name.removeprefix(PREFIX).partition(":")
    parts = repo.split("/")
    if len(parts) != 2 or not all(_NAME.fullmatch(p) and ".." not in p for p in parts):
        raise CadenceError(
            f"'{name}' is not a hub model: write hf:OWNER/REPO for an HF model directory or hf:OWNER/REPO:FILE.gguf "
            "for one GGUF file of it, e.g. hf:Qwen/Qwen2.5-0.5B-Instruct"
        )
    if file and (file.startswith("/") or ".." in file.split("/") or not file.endswith(".gguf")):
        raise CadenceError(
            f"'{name}' names {file}, which is not a .gguf file of the repository; give hf:{repo}:FILE.gguf, or "
            f"hf:{repo} for its HF model directory"
        )
    return HubRef(repo, file or None)


def hub_root() -> Path:
    return paths.models_dir() / "hf"


def repo_dir(ref: HubRef) -> Path:
    return hub_root() / ref.repo


def local_path(ref: HubRef) -> Path:
    return repo_dir(ref) / ref.file if ref.file else repo_dir(ref)


def read_manifest(folder: Path) -> dict:
    """What was verified into a repository's folder: {"files": {name: {"size", "sha256" | "git_sha1"}},
    "directory": [names] once the HF model directory is complete}."""
    try:
        got = json.loads((folder / MANIFEST).read_text())
        return got if isinstance(got, dict) and isinstance(got.get("files"), dict) else {"files": {}}
    except (OSError, ValueError):
        return {"files": {}}


def write_manifest(folder: Path, manifest: dict) -> None:
    tmp = folder / f"{MANIFEST}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    os.replace(tmp, folder / MANIFEST)


def has_file(folder: Path, manifest: dict, name: str, want: dict | None = None) -> bool:
    """`name` is in `folder`, verified, with its recorded size (and, given `want`, the hash the hub gives now)."""
    got = manifest["files"].get(name)
    if not isinstance(got, dict) or (want is not None and got != want):
        return False
    try:
        return (folder / name).stat().st_size == got.get("size")
    except OSError:
        return False


def is_pulled(ref: HubRef) -> bool:
    folder = repo_dir(ref)
    m = read_manifest(folder)
    names = [ref.file] if ref.file else m.get("directory")
    return bool(names) and all(has_file(folder, m, n) for n in names)


def recorded_sha256(ref: HubRef) -> str | None:
    """The verified sha256 of a pulled GGUF file (the source identity of its weight stores), else None."""
    if not ref.file:
        return None
    return (read_manifest(repo_dir(ref))["files"].get(ref.file) or {}).get("sha256")


def pulled() -> list[str]:
    """The hub models on this machine, by the names that resolve to them (hf:OWNER/REPO[:FILE])."""
    names = []
    root = hub_root()
    for folder in sorted(root.glob(f"*/*/{MANIFEST}")) if root.is_dir() else []:
        folder = folder.parent
        repo = f"{folder.parent.name}/{folder.name}"
        m = read_manifest(folder)
        if m.get("directory") and is_pulled(HubRef(repo, None)):
            names.append(f"{PREFIX}{repo}")
        names += [f"{PREFIX}{repo}:{f}" for f in sorted(m["files"]) if f.endswith(".gguf") and has_file(folder, m, f)]
    return names


def pulled_bytes(ref: HubRef) -> int:
    folder = repo_dir(ref)
    m = read_manifest(folder)
    return sum(m["files"][n]["size"] for n in ([ref.file] if ref.file else m.get("directory") or []))


def choose_files(ref: HubRef, remote: dict) -> list[str]:
    """The files of the repository (`remote`: name -> its hub metadata) that make `ref`."""
    if ref.file:
        if ref.file not in remote:
            ggufs = [n for n in sorted(remote) if n.endswith(".gguf")]
            has = f"its GGUF files: {', '.join(ggufs[:8])}" if ggufs else "it has no GGUF files"
            raise CadenceError(f"{ref.repo} on the hub has no file {ref.file} (404); {has}")
        return [ref.file]
    top = [n for n in sorted(remote) if "/" not in n]
    weights = [n for n in top if n.endswith(".safetensors")]
    missing = [n for n in DIRECTORY_FILES if n not in remote] + ([] if weights else ["*.safetensors"])
    if missing:
        ggufs = [n for n in sorted(remote) if n.endswith(".gguf")]
        hint = f"; for one of its GGUF files give {PREFIX}{ref.repo}:{ggufs[0]}" if ggufs else ""
        raise CadenceError(
            f"{ref.repo} on the hub is not an HF model directory cadence reads: it has no {', '.join(missing)}{hint}"
        )
    extra = [n for n in (*OPTIONAL_FILES, *top) if n in remote and (n in OPTIONAL_FILES or n.endswith(".index.json"))]
    return [*DIRECTORY_FILES, *dict.fromkeys(extra), *weights]


@contextmanager
def _locked(folder: Path):
    """One pull of a repository at a time: a second waits, rather than append to the same partial file."""
    fd = os.open(folder / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def pull(ref: HubRef, progress=None) -> Path:
    """Fetch `ref` from the hub and verify it (nothing to do once pulled); return its local path."""
    from pulls import hub_fetch

    if is_pulled(ref):
        return local_path(ref)
    dest = paths.writable_dir(repo_dir(ref))
    staging = paths.writable_dir(hub_root() / ".partial" / ref.repo)
    own = progress is None
    if own:
        from common.bars import download_bar

        progress = download_bar()
        progress.start()
    try:
        with _locked(staging):
            commit, remote = hub_fetch.listing(ref)
            wanted = choose_files(ref, remote)
            manifest = read_manifest(dest)
            todo = [n for n in wanted if not has_file(dest, manifest, n, remote[n].record())]
            hub_fetch.check_room(ref, [remote[n] for n in todo], staging, dest)
            for n in todo:
                hub_fetch.fetch(ref, commit, remote[n], staging, dest / n, progress)
                manifest = read_manifest(dest)
                manifest["files"][n] = remote[n].record()
                write_manifest(dest, {**manifest, "repo": ref.repo, "revision": commit})
            if not ref.file:
                write_manifest(dest, {**read_manifest(dest), "directory": wanted})
    finally:
        if own:
            progress.stop()
        _tidy(staging, dest)
    return local_path(ref)


def _tidy(staging: Path, dest: Path) -> None:
    """Leave no empty folder behind: the staging folder once nothing partial is in it, a repository's folder
    that holds nothing verified."""
    if not any(p.name != ".lock" for p in staging.rglob("*")):
        shutil.rmtree(staging, ignore_errors=True)
        for up in (staging.parent, staging.parent.parent):
            try:
                up.rmdir()
            except OSError:
                break
    if dest.is_dir() and not any(dest.iterdir()):
        dest.rmdir()
        try:
            dest.parent.rmdir()
        except OSError:
            pass
