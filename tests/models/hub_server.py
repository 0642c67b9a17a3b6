"""A local Hugging Face hub for the tests: a real HTTP server, in a thread, answering the routes huggingface_hub
calls the way the hub does (`HF_ENDPOINT` points the client at it).

- `GET /api/models/OWNER/REPO[/revision/REV]?blobs=true`: the repository's commit and its files (`siblings`: size,
  blobId, and `lfs` {sha256, size, pointerSize} for a large file);
- `HEAD|GET /OWNER/REPO/resolve/REV/FILE`: a file in git answers itself (ETag: its git blob id); a large (LFS) file
  answers 302 to `/cdn/SHA256` on another host (`localhost`, where the hub is `127.0.0.1`) with X-Repo-Commit, X-Linked-Etag (its sha256) and X-Linked-Size;
- `GET /cdn/SHA256`: the bytes, a Range request answered 206 with Content-Range.

Errors as the hub gives them: 404 with X-Error-Code RepoNotFound or EntryNotFound, 401 for a private repository
asked without its token, 403 GatedRepo for a gated one whose terms the token's user has not accepted. What a test can break: `corrupt` (the bytes differ from the sha256 listed), `drop` (the
first GET stops after so many bytes and closes the connection; later ones answer 503 until `heal`), `claim`
(a file listed larger than it is). Every request is kept in `requests` (method, path, Range header).
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

COMMIT = "0123456789abcdef0123456789abcdef01234567"
LFS_SUFFIXES = (".gguf", ".safetensors", ".bin")


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class LocalHub:
    def __init__(self):
        self.repos: dict[str, dict[str, bytes]] = {}
        self.private: set[str] = set()
        self.gated: set[str] = set()  # answers 403 GatedRepo even with the token: its terms are not accepted
        self.token = "hf_local_test_token"
        self.corrupt: set[tuple[str, str]] = set()
        self.drop: dict[tuple[str, str], int] = {}
        self.broken: set[tuple[str, str]] = set()
        self.claim: dict[tuple[str, str], int] = {}
        self.requests: list[tuple[str, str, str | None]] = []
        self.shas: dict[str, tuple[str, str]] = {}
        self.sha_of: dict[tuple[str, str], str] = {}
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        # the same server under another host name: as the hub's large files, it is not the hub
        self.cdn = f"http://localhost:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> LocalHub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def add(self, repo: str, files: dict[str, bytes]) -> None:
        self.repos[repo] = dict(files)
        for name, data in files.items():
            self.sha_of[repo, name] = sha = hashlib.sha256(data).hexdigest()
            self.shas[sha] = (repo, name)  # the CDN is content-addressed: one file of those bytes answers

    def heal(self) -> None:
        self.broken.clear()

    def lfs(self, name: str) -> bool:
        return name.endswith(LFS_SUFFIXES)

    def sibling(self, repo: str, name: str) -> dict:
        data = self.repos[repo][name]
        size = self.claim.get((repo, name), len(data))
        s = {"rfilename": name, "size": size, "blobId": git_blob_id(data)}
        if self.lfs(name):
            s["lfs"] = {"sha256": self.sha_of[repo, name], "size": size, "pointerSize": 134}
        return s

    def by_sha(self, sha: str) -> tuple[str, str, bytes] | None:
        if sha not in self.shas:
            return None
        repo, name = self.shas[sha]
        return repo, name, self.repos[repo][name]


def _handler(hub: LocalHub):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):  # quiet
            pass

        def do_HEAD(self):
            self._route(body=False)

        def do_GET(self):
            self._route(body=True)

        def _route(self, body: bool):
            path = self.path.split("?", 1)[0]
            hub.requests.append((self.command, path, self.headers.get("Range")))
            parts = path.strip("/").split("/")
            if parts[:2] == ["api", "models"] and len(parts) >= 4:
                return self._listing("/".join(parts[2:4]))
            if parts[0] == "cdn" and len(parts) == 2:
                return self._cdn(parts[1], body)
            if len(parts) >= 5 and parts[2] == "resolve":
                return self._resolve("/".join(parts[:2]), "/".join(parts[4:]), body)
            self._send(404, b"", {})

        def _allowed(self, repo: str) -> bool:
            if repo not in hub.repos:
                self._send(404, b"Repository not found", {"X-Error-Code": "RepoNotFound"})
                return False
            if repo in hub.private and self.headers.get("Authorization") != f"Bearer {hub.token}":
                self._send(401, b"Invalid username or password.", {})
                return False
            if repo in hub.gated:
                self._send(403, b"", {"X-Error-Code": "GatedRepo", "X-Error-Message": "Access to model is restricted"})
                return False
            return True

        def _listing(self, repo: str):
            if self._allowed(repo):
                info = {"id": repo, "sha": COMMIT, "siblings": [hub.sibling(repo, n) for n in sorted(hub.repos[repo])]}
                self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"})

        def _resolve(self, repo: str, name: str, body: bool):
            if not self._allowed(repo):
                return
            if name not in hub.repos[repo]:
                return self._send(404, b"Entry not found", {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": COMMIT})
            s = hub.sibling(repo, name)
            if "lfs" in s:
                sha = s["lfs"]["sha256"]
                headers = {
                    "Location": f"{hub.cdn}/cdn/{sha}",
                    "X-Repo-Commit": COMMIT,
                    "X-Linked-Etag": f'"{sha}"',
                    "X-Linked-Size": str(s["size"]),
                    "ETag": f'"{s["blobId"]}"',
                }
                return self._send(302, b"", headers)
            data = hub.repos[repo][name]
            self._send(200, data if body else b"", {"ETag": f'"{s["blobId"]}"', "X-Repo-Commit": COMMIT}, len(data))

        def _cdn(self, sha: str, body: bool):
            found = hub.by_sha(sha)
            if found is None:
                return self._send(404, b"", {})
            repo, name, data = found
            key = (repo, name)
            if body and key in hub.broken:
                return self._send(503, b"Service Unavailable", {})
            if key in hub.corrupt:
                data = bytes([data[0] ^ 0xFF]) + data[1:]
            start = 0
            rng = self.headers.get("Range")
            if rng and rng.startswith("bytes=") and rng.endswith("-"):
                start = int(rng[6:-1])
            chunk = data[start:]
            headers = {"Accept-Ranges": "bytes"}
            status = 200
            if start:
                status = 206
                headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            if body and key in hub.drop:
                cut = hub.drop.pop(key)
                hub.broken.add(key)
                self._send(status, chunk[:cut], headers, len(chunk))
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(2)  # the connection drops midway
                return
            self._send(status, chunk if body else b"", headers, len(chunk))

        def _send(self, status: int, data: bytes, headers: dict, length: int | None = None):
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(data) if length is None else length))
            self.end_headers()
            if data and self.command != "HEAD":
                self.wfile.write(data)

    return Handler
