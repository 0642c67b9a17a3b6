"""llama.cpp's own server with parallel slots (`llama-server -np N`) as a baseline for issue 42: the same prompts'
token ids sent by N clients at once (greedy, each stopping at its end of text or after `max_new` tokens), the
aggregate tokens/s and each request's time to first token and tokens/s, as bench/parallel.py reports ours.

`child` runs inside the cgroup (bench/parallel.py puts it there), so the server it starts is charged to it too.
The server is a build of llama.cpp (`cmake --build build --target llama-server`): pip's llama-cpp-python does not
ship it."""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import threading
import time
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stream(port: int, body: dict, t0: float, timeout: float) -> tuple[float, list[int], dict]:
    """A streamed completion: (when its first token came, after t0; its tokens; the server's timings)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    c.request("POST", "/completion", json.dumps(dict(body, stream=True)), {"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError(f"llama-server answered {r.status}: {r.read()[:300]!r}")
    first, tokens, timings = None, [], {}
    for line in r:
        if not line.startswith(b"data: "):
            continue
        event = json.loads(line[6:])
        tokens += event.get("tokens", [])
        if tokens and first is None:
            first = time.perf_counter() - t0
        if event.get("stop"):
            timings = event.get("timings", {})
            break
    return first, tokens, timings


def _wait_ready(port: int, proc: subprocess.Popen, timeout: float) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode} before it was ready")
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"llama-server was not ready in {timeout:.0f} s")


def child(server: str, gguf: str, prompts: dict, n: int, max_new: int, threads: int = 2) -> dict:
    """Serve `prompts` (id -> token ids) with `n` slots (0: one slot, the requests one after another), `n` clients
    sending them at once; the figures bench/parallel.py prints."""
    slots = max(n, 1)
    ctx = slots * (max(len(p) for p in prompts.values()) + max_new + 16)
    port = _free_port()
    argv = [server, "-m", gguf, "-t", str(threads), "-tb", str(threads), "-np", str(slots), "-c", str(ctx)]
    argv += ["--port", str(port), "--host", "127.0.0.1", "--no-webui", "-lv", "0"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_ready(port, proc, 300)
        queue, lock = list(prompts.items()), threading.Lock()
        first, ends, ids, each = {}, {}, {}, {}
        t0 = time.perf_counter()

        def client():
            while True:
                with lock:
                    if not queue:
                        return
                    pid, toks = queue.pop(0)
                body = dict(prompt=list(toks), n_predict=max_new, temperature=0.0, top_k=1, cache_prompt=False)
                first[pid], ids[pid], t = _stream(port, dict(body, return_tokens=True), t0, 3600)
                ends[pid] = time.perf_counter() - t0
                each[pid] = t.get("predicted_per_second", 0.0)

        threads_ = [threading.Thread(target=client) for _ in range(slots if n else 1)]
        for th in threads_:
            th.start()
        for th in threads_:
            th.join()
        wall = time.perf_counter() - t0
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
    return {
        "wall_s": wall,
        "tokens": sum(len(v) for v in ids.values()),
        "ids": ids,
        "ttft_s": first,
        "end_s": ends,
        "tokens_per_s": each,
        "width": "-",
    }


def write(out: str, result: dict) -> None:
    Path(out).write_text(json.dumps(result))
