"""Time to first token of a conversation's next turn, four conversations interleaved over two slots (issue 57,
item 3): `launch serve --parallel 2` with and without its prompt cache, resident and under a memory budget (the
server inside a memory cgroup of that size, the model files evicted from the page cache first), the official
`openai` client sending each conversation's turns in turn, streamed, greedy.

Each conversation has a system prompt of its own of about 1,000 tokens (a quarter of README.md's text each, so no
two share one), then a question; every next turn adds the answer and a new question. With two slots and four
conversations, a next turn never finds its conversation in a slot: without the cache it prefills its whole prompt
again, with it only the tokens since its last turn. The first turns are the cold prefills the next turns are
measured against; the answers of the two runs must match token for token.

    python -m bench.prompt_cache [--memory-budget 768MiB] [--turns 3] [--max-tokens 16] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
QUESTIONS = [
    ["What is this text about?", "Say it in fewer words.", "What would you add?", "Anything else?"],
    ["Which part matters most here?", "Why?", "Give an example.", "Go on."],
    ["Summarise the text above.", "What is unclear in it?", "How would you fix that?", "And then?"],
    ["Name one thing this text promises.", "Is it kept?", "How would you check?", "Go on."],
]


def systems(n: int = 4, chars: int = 4200) -> list[str]:
    """`n` system prompts of about a thousand tokens each, none sharing a prefix with another."""
    text = (ROOT / "README.md").read_text()
    return [
        f"Read this part of a project's README, then answer.\n\n{text[i * chars : (i + 1) * chars]}" for i in range(n)
    ]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server(args: list[str], budget: int | None, evict: list[Path], log=None, command=None):
    """`launch serve ARGS` (inside a memory cgroup of `budget` bytes, the files in `evict` out of the page cache
    first; its stderr to the file `log` where given), its base URL once /health answers; stopped (SIGTERM) at the
    end. `command(port)`: another server's command line instead (llama-server)."""
    import httpx

    from bench.cgroup import MemoryCgroup
    from shm.dio import evict_page_cache

    port = _free_port()
    argv = [str(Path(sys.executable).parent / "launch"), "serve", "--port", str(port), *args]  # the front door
    argv = command(port) if command else argv
    with MemoryCgroup(budget) if budget else contextlib.nullcontext() as cg:
        evict_page_cache(evict)
        fd = os.open(cg.dir / "cgroup.procs", os.O_WRONLY | os.O_CLOEXEC) if cg else None
        join = (lambda: os.write(fd, str(os.getpid()).encode())) if fd is not None else None
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stderr=log, preexec_fn=join, cwd=ROOT)
        if fd is not None:
            os.close(fd)
        try:
            url, end = f"http://127.0.0.1:{port}", time.monotonic() + 900
            while time.monotonic() < end:
                if proc.poll() is not None:
                    raise SystemExit(f"{argv[0]} exited with {proc.returncode} before it was ready{_said(log)}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                time.sleep(0.5)
            yield url, cg
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


def _said(log) -> str:
    """The last lines a server wrote to `log` (a file this process can read back), to say why it stopped."""
    if not (hasattr(log, "seekable") and log.seekable() and log.readable()) or log in (sys.stderr, sys.stdout):
        return ""
    try:
        log.flush()
        log.seek(0)
        text = log.read()
    except (OSError, ValueError):
        return ""
    text = text.decode(errors="replace") if isinstance(text, bytes) else text
    tail = [ln.rstrip() for ln in text.splitlines() if ln.strip()][-5:]
    return ":\n" + "\n".join(tail) if tail else ""


def talk(url: str, turns: int, max_tokens: int) -> list[dict]:
    """Each turn, each conversation in turn: its time to first token, its answer, its prompt and reused tokens."""
    import httpx
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="none", timeout=3600)
    model = client.models.list().data[0].id
    convs = [[{"role": "system", "content": s}] for s in systems()]
    rows = []
    for turn in range(turns):
        for i, conv in enumerate(convs):
            conv.append({"role": "user", "content": QUESTIONS[i][turn % len(QUESTIONS[i])]})
            t0, first, text = time.perf_counter(), None, ""
            stream = client.chat.completions.create(
                model=model, messages=conv, max_tokens=max_tokens, temperature=0, stream=True
            )
            for chunk in stream:
                delta = chunk.choices[0].delta.content if chunk.choices else None
                if delta and first is None:
                    first = time.perf_counter() - t0
                text += delta or ""
            conv.append({"role": "assistant", "content": text})
            rows.append(dict(turn=turn, conversation=i, ttft_s=first, total_s=time.perf_counter() - t0, text=text))
    metrics = httpx.get(url + "/metrics", timeout=30).text
    for line in metrics.splitlines():
        if line.startswith(("cadence_prompt_tokens_total", "cadence_prompt_tokens_reused_total")):
            name, value = line.split()
            rows.append(dict(metric=name, value=float(value)))
    return rows


def pair_files() -> list[Path]:
    """The weight files of the default pair (the target and its draft, every format converted), to evict before a
    budgeted run."""
    from engine.config import RunConfig
    from engine.machine import ThisMachine
    from pulls.registry import DEFAULT_DRAFT

    cfg, machine = RunConfig.from_options(), ThisMachine(lambda s: None)
    stores = Path(machine.store(cfg.target, cfg.dtype).dir).parent
    return [p for m in (cfg.target, DEFAULT_DRAFT) for p in stores.glob(f"{m}-*/*.bin")]


def run(budget: str | None, cache: str, turns: int, max_tokens: int) -> dict:
    from common.units import parse_bytes

    args = ["--parallel", "2", "--no-trace", "--prompt-cache", cache]
    args += ["--memory-budget", budget] if budget else []
    with server(args, parse_bytes(budget) if budget else None, pair_files()) as (url, cg):
        rows = talk(url, turns, max_tokens)
        peak = cg.peak_held if cg else None
    return dict(budget=budget, cache=cache, rows=rows, peak_held=peak)


def summary(result: dict) -> dict:
    rows = [r for r in result["rows"] if "turn" in r]
    cold = [r["ttft_s"] for r in rows if r["turn"] == 0]
    nxt = [r["ttft_s"] for r in rows if r["turn"] > 0]
    metrics = {r["metric"]: r["value"] for r in result["rows"] if "metric" in r}
    return dict(
        cold_ttft_s=statistics.median(cold),
        next_ttft_s=statistics.median(nxt),
        ratio=statistics.median(nxt) / statistics.median(cold),
        reused=metrics.get("cadence_prompt_tokens_reused_total"),
        prompt=metrics.get("cadence_prompt_tokens_total"),
    )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--memory-budget", default=None)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="cadence-prompt-cache-"))
    try:
        results = {
            c: run(a.memory_budget, c if c == "off" else str(folder), a.turns, a.max_tokens) for c in ("off", "on")
        }
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    off, on = (results[c] for c in ("off", "on"))
    same = [r["text"] for r in off["rows"] if "turn" in r] == [r["text"] for r in on["rows"] if "turn" in r]
    print(f"budget {a.memory_budget or 'none (resident)'}; four conversations over two slots; answers equal: {same}")
    print(
        f"{'':<10}{'cold TTFT':>12}{'next TTFT':>12}{'next/cold':>11}{'reused':>10}{'of prompt':>11}{'peak held':>12}"
    )
    for name, r in results.items():
        s = summary(r)
        peak = f"{r['peak_held'] / 2**20:.0f} MiB" if r["peak_held"] else "-"
        print(
            f"{name:<10}{s['cold_ttft_s']:>11.2f}s{s['next_ttft_s']:>11.2f}s{s['ratio']:>11.3f}"
            f"{s['reused'] or 0:>10.0f}{s['prompt'] or 0:>11.0f}{peak:>12}"
        )
    print(f"next turn with the cache / without: {summary(on)['next_ttft_s'] / summary(off)['next_ttft_s']:.3f}")
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
