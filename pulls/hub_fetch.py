"""The hub's side of `launch models pull hf:...` (pulls/hub.py), through huggingface_hub, the hub's own client.

The repository's listing (`HfApi.model_info` with its files' metadata: `GET /api/models/OWNER/REPO/revision/main
?blobs=true`) gives each file's size and either its LFS sha256 or its git blob id; every file is then fetched at
that commit: `HEAD /OWNER/REPO/resolve/COMMIT/FILE` (the hub's ETag, X-Linked-Etag for an LFS file, and the
Location a large file redirects to), then a GET there, from the first byte not yet on disk (a Range request).
`hf_hub_download` is not used: it deletes a partial download when it fails, so a pull could not continue
where it stopped. A file is renamed into place only once its bytes hash to what the listing says.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from common.errors import CadenceError
from common.files import no_space

DEFAULT_ENDPOINT = "https://huggingface.co"
LISTING_TIMEOUT_S = 30
CHUNK = 8 << 20


@dataclass(frozen=True)
class Remote:
    """A file of the repository as the hub lists it."""

    name: str
    size: int
    sha256: str | None  # an LFS file's
    blob_id: str | None  # a file in git itself: its git blob id (sha1)

    def record(self) -> dict:
        """What `.cadence-pull.json` keeps of it once verified."""
        return {"size": self.size, **({"sha256": self.sha256} if self.sha256 else {"git_sha1": self.blob_id})}

    @property
    def expected(self) -> str:
        return self.sha256 or self.blob_id or ""


def endpoint() -> str:
    """The hub: $HF_ENDPOINT (a mirror, or the tests' local server), else huggingface.co."""
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def _quiet() -> None:
    """huggingface_hub's own progress bars and retry warnings off: the pull shows its own bar, and what went
    wrong ends in one sentence."""
    from huggingface_hub.utils import disable_progress_bars, logging

    disable_progress_bars()
    logging.set_verbosity_error()


def listing(ref) -> tuple[str, dict[str, Remote]]:
    """(the commit the default branch is at, {file name: Remote}) of `ref`'s repository."""
    from huggingface_hub import HfApi

    _quiet()
    with hub_errors(ref):
        info = HfApi(endpoint=endpoint()).model_info(ref.repo, files_metadata=True, timeout=LISTING_TIMEOUT_S)
    remote = {}
    for s in info.siblings or []:
        if s.size is None or not (s.lfs or s.blob_id):
            raise CadenceError(
                f"the hub at {endpoint()} listed {ref.repo} without its files' sizes and hashes; check HF_ENDPOINT"
            )
        remote[s.rfilename] = Remote(s.rfilename, int(s.size), s.lfs.sha256 if s.lfs else None, s.blob_id)
    if not info.sha:
        raise CadenceError(f"the hub at {endpoint()} gave no commit for {ref.repo}; check HF_ENDPOINT")
    return info.sha, remote


def partial_path(staging: Path, r: Remote) -> Path:
    """Where `r` is downloaded to until it is verified: named by the hash it must have, so a download continued
    after the file changed on the hub does not join two versions."""
    return staging / f"{r.name}.{r.expected[:16]}.partial"


def check_room(ref, todo: list[Remote], staging: Path, dest: Path) -> None:
    """Refuse a pull that cannot fit, before it downloads anything."""
    left = sum(r.size - _size(partial_path(staging, r)) for r in todo)
    free = shutil.disk_usage(dest).free
    if left > free:
        raise CadenceError(
            f"not enough free disk under {dest} for {ref.name}: it needs {left / 1e9:.2f} GB more and "
            f"{free / 1e9:.2f} GB are free; free some space, or point CADENCE_HOME at a disk with room"
        )


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def fetch(ref, commit: str, r: Remote, staging: Path, final: Path, progress=None) -> None:
    """Download `r` at `commit` (continuing a partial download), verify it, and rename it to `final`."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    part = partial_path(staging, r)
    part.parent.mkdir(parents=True, exist_ok=True)
    have = _size(part)
    if have > r.size:  # not a prefix of this file
        part.unlink()
        have = 0
    task = progress.add_task(f"{ref.repo} {r.name}", total=r.size, completed=have) if progress else None
    with hub_errors(ref, part):
        url = hf_hub_url(ref.repo, r.name, revision=commit, endpoint=endpoint())
        meta = get_hf_file_metadata(url)
        if meta.etag and meta.etag != r.expected:
            raise CadenceError(
                f"the hub's listing of {ref.repo} and its file {r.name} disagree (hash {r.expected[:16]}... against "
                f"{meta.etag[:16]}...); run `launch models pull {ref.name}` again"
            )
        headers = build_hf_headers()
        if urlparse(meta.location).netloc != urlparse(url).netloc:
            headers.pop("authorization", None)  # a signed CDN address: the token stays with the hub
        with open(part, "ab") as f:
            http_get(
                meta.location, _Counted(f, progress, task), resume_size=have, headers=headers, expected_size=r.size
            )
    got = file_hash(part, r)
    if got != r.expected:
        part.unlink()
        raise CadenceError(
            f"{r.name} of {ref.repo} does not match the hub's {'sha256' if r.sha256 else 'git hash'} "
            f"({got[:16]}... where the hub says {r.expected[:16]}...), so it was deleted; run "
            f"`launch models pull {ref.name}` again"
        )
    final.parent.mkdir(parents=True, exist_ok=True)
    os.replace(part, final)


def file_hash(path: Path, r: Remote) -> str:
    """The sha256 of an LFS file, the git blob id (sha1 of "blob SIZE\\0" and the bytes) of a file in git."""
    h = hashlib.sha256() if r.sha256 else hashlib.sha1(f"blob {path.stat().st_size}\0".encode())
    with open(path, "rb") as f:
        while b := f.read(CHUNK):
            h.update(b)
    return h.hexdigest()


class _Counted:
    """The partial file, as http_get writes it, moving the pull's progress bar."""

    def __init__(self, f, progress, task):
        self.f, self.progress, self.task = f, progress, task

    def write(self, b) -> int:
        n = self.f.write(b)
        if self.progress is not None:
            self.progress.advance(self.task, len(b))
        return n

    def seek(self, *a):
        return self.f.seek(*a)

    def tell(self) -> int:
        return self.f.tell()

    def truncate(self, *a):  # the server ignored the Range request: the download starts over
        n = self.f.truncate(*a)
        if self.progress is not None:
            self.progress.update(self.task, completed=self.f.tell())
        return n


@contextmanager
def hub_errors(ref, writing: Path | None = None):
    """What the hub or the network answered, as one sentence saying what to do."""
    import httpx2
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, OfflineModeIsEnabled, RemoteEntryNotFoundError

    again = f"run `launch models pull {ref.name}` again (a download continues where it stopped)"
    try:
        yield
    except GatedRepoError:
        raise CadenceError(
            f"{ref.repo} is gated on the hub: accept its terms on its page and set HF_TOKEN to a token of that account"
        ) from None
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else 0
        raise _http_error(ref, status, again, isinstance(e, RemoteEntryNotFoundError)) from None
    except OfflineModeIsEnabled:
        raise CadenceError(f"HF_HUB_OFFLINE is set, so {ref.name} cannot be pulled; unset it") from None
    except (httpx2.TransportError, ConnectionError) as e:
        why = _transport_why(e)
        raise CadenceError(
            f"cannot reach the Hugging Face hub at {endpoint()} ({why}); check the network or HF_ENDPOINT, then {again}"
        ) from None
    except (ValueError, KeyError, TypeError) as e:  # an answer that is not the hub's (an HTML page, ...)
        raise CadenceError(
            f"{endpoint()} did not answer for {ref.name} as the Hugging Face hub does ({type(e).__name__}: {e}); "
            "check HF_ENDPOINT"
        ) from None
    except OSError as e:
        full = no_space(e, writing or Path(ref.repo))
        if full is not None:
            raise full from None
        if writing is not None and "Consistency check failed" in str(e):
            raise CadenceError(f"the download of {ref.name} ended early; {again}") from None
        raise CadenceError(f"cannot write {writing or ref.name} ({e.strerror or e}); check the folder") from None


def _http_error(ref, status: int, again: str, entry: bool) -> CadenceError:
    if status in (401, 403):
        return CadenceError(
            f"the hub refused access to {ref.repo} ({status}): it is private or gated, or does not exist; set HF_TOKEN "
            "to a token that may read it (and accept the model's terms on its page)"
        )
    if status == 404:
        what = f"no file {ref.file} in {ref.repo}" if entry and ref.file else f"no repository {ref.repo}"
        return CadenceError(f"the hub has {what} (404); check the name in {ref.name}")
    return CadenceError(f"the Hugging Face hub answered {status} for {ref.name}; try again later: {again}")


def _transport_why(e: Exception) -> str:
    import httpx2

    if isinstance(e, httpx2.TimeoutException):
        return "it did not answer in time"
    if isinstance(e, (httpx2.RemoteProtocolError, httpx2.ReadError)):
        return "the connection dropped"
    return "no connection"
