"""Several users through the server (issue 56): `launch serve` inside a memory cgroup of the budget (the model files
evicted from the page cache first), N clients of the official `openai` client sending the held-out prompts at once
(each takes the next prompt as its last one ends), streamed, greedy; the aggregate tokens/s, each request's time to
its first token, the cgroup's peak of what the processes hold, and the plan the server printed. Against it, the best
plan for one request: `launch serve --parallel 1` with each draft choice (`--draft auto`, the n-gram trie alone
`--draft none`), one client sending the same prompts one after another; the best of them is "one".

    python -m bench.serve_clients --memory-budget 768MiB --clients 1,2,4 --limit 4 --max-tokens 64

Every answer is compared with the one-at-a-time answer of the same prompt (greedy: they must be equal)."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from bench.prompt_cache import pair_files, server

HELDOUT = Path(__file__).resolve().parent.parent / "engine" / "assets" / "heldout.jsonl"


def send(url: str, prompts: list[dict], clients: int, max_tokens: int) -> dict:
    """`clients` threads sending `prompts` (each the next one left) as streamed completions; per prompt its time to
    first token after the start, its tokens and text; the wall time of all."""
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="none", timeout=3600)
    model = client.models.list().data[0].id
    client.completions.create(model=model, prompt="def f():", max_tokens=1, temperature=0)  # first-call setup
    queue, lock, rows = list(prompts), threading.Lock(), {}

    def one():
        while True:
            with lock:
                if not queue:
                    return
                p = queue.pop(0)
            t0, first, text, tokens, chunks = time.perf_counter(), None, "", 0, 0
            stream = client.completions.create(
                model=model,
                prompt=p["prompt"],
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            for chunk in stream:
                if chunk.choices and chunk.choices[0].text:
                    first = first if first is not None else time.perf_counter() - t0
                    text, chunks = text + chunk.choices[0].text, chunks + 1
                if chunk.usage:
                    tokens = chunk.usage.completion_tokens
            tokens = tokens or chunks  # a server that sends no usage: a token a chunk (llama-server streams so)
            rows[p["id"]] = dict(ttft_s=first, total_s=time.perf_counter() - t0, tokens=tokens, text=text)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return dict(wall_s=time.perf_counter() - t0, rows=rows)


def run(
    budget: str | None, slots: int, clients: int, draft: str, prompts: list[dict], max_tokens: int, kv: str = "f16"
) -> dict:
    """One server (`--parallel slots --draft draft --kv-dtype kv`) and `clients` clients: the figures and the plan it
    printed."""
    from common.units import parse_bytes

    args = ["--parallel", str(slots), "--draft", draft, "--kv-dtype", kv, "--no-trace", "--quiet", "--no-monitor"]
    args += ["--memory-budget", budget] if budget else []
    with tempfile.TemporaryFile("w+") as log:
        with server(args, parse_bytes(budget) if budget else None, pair_files(), log) as (url, cg):
            out = send(url, prompts, clients, max_tokens)
            out["peak_held"] = cg.peak_held if cg else None
        log.seek(0)
        out["plan"] = [ln.strip() for ln in log.read().splitlines() if not ln.startswith("launch serve")][:3]
    tokens = sum(r["tokens"] for r in out["rows"].values())
    out.update(slots=slots, clients=clients, draft=draft, kv=kv, tokens=tokens, tok_s=tokens / out["wall_s"])
    return out


def run_llama(binary: str, gguf: str, budget: str | None, n: int, prompts: list[dict], max_tokens: int) -> dict:
    """llama.cpp's own server with `-np n` slots, in the same cgroup, its GGUF evicted first, and `n` clients."""
    from common.units import parse_bytes

    def command(port: int) -> list[str]:
        ctx = max(n, 1) * 512  # each slot's share, as ours: the longest prompt and its answer, with room
        return [binary, "-m", gguf, "-t", "2", "-tb", "2", "-np", str(max(n, 1)), "-c", str(ctx), "--port", str(port)]

    with server([], parse_bytes(budget) if budget else None, [Path(gguf)], subprocess.DEVNULL, command) as (url, cg):
        out = send(url, prompts, n, max_tokens)
        out["peak_held"] = cg.peak_held if cg else None
    tokens = sum(r["tokens"] for r in out["rows"].values())
    out.update(slots=n, clients=n, draft=f"llama-server -np {n}", tokens=tokens, tok_s=tokens / out["wall_s"], plan=[])
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--memory-budget", default=None)
    p.add_argument("--clients", default="1,2,4")
    p.add_argument("--single-drafts", default="auto,none", help="the draft choices tried for the best plan for one")
    p.add_argument("--limit", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--serve-default", action="store_true", help="also the most clients against --parallel 0")
    p.add_argument("--llama-server", default=None, help="a llama-server binary: -np 1 and -np N on the same prompts")
    p.add_argument("--gguf", default=None, help="the GGUF it runs (default: the pulled default target's)")
    p.add_argument("--llama-clients", default=None, help="llama-server's -np values (default: 1 and --clients)")
    p.add_argument("--ours-from", default=None, help="our rows from an earlier --out (llama-server's runs only)")
    p.add_argument(
        "--kv-dtypes", default="f16", help="the servers' --kv-dtype, every run at each (default: the doors' own)"
    )
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    kvs = a.kv_dtypes.split(",")
    prompts = [json.loads(ln) for ln in HELDOUT.read_text().splitlines() if ln.strip()][: a.limit]
    ns = [int(n) for n in a.clients.split(",")]
    if a.ours_from:
        got = json.loads(Path(a.ours_from).read_text())
        singles, many = got["singles"], got["many"]
    else:
        drafts = a.single_drafts.split(",")
        singles = [run(a.memory_budget, 1, 1, d, prompts, a.max_tokens, kv) for kv in kvs for d in drafts]
        many = [run(a.memory_budget, n, n, "auto", prompts, a.max_tokens, kv) for n in ns for kv in kvs]
        if a.serve_default:  # the most clients against serve's own choice of slots (--parallel 0)
            many += [run(a.memory_budget, 0, max(ns), "auto", prompts, a.max_tokens, kv) for kv in kvs]
    llama = []
    if a.llama_server:
        from pulls.wheels import model_path
        from pulls.registry import DEFAULT_TARGET, spec

        gguf = a.gguf or str(model_path(spec(DEFAULT_TARGET)))
        ls = [int(n) for n in (a.llama_clients or ",".join(map(str, sorted({1, *ns})))).split(",")]
        llama = [run_llama(a.llama_server, gguf, a.memory_budget, n, prompts, a.max_tokens) for n in ls]
    if a.out:  # (before the table: a run's rows are never lost to it)
        Path(a.out).write_text(json.dumps(dict(singles=singles, many=many, llama=llama), indent=1))
    table(a, prompts, singles, many, llama)


def table(a, prompts, singles, many, llama) -> None:
    best = max(singles, key=lambda r: r["tok_s"])
    first = {}  # each KV dtype's first single run: the text every run at that dtype must write
    for r in singles:
        first.setdefault(r.get("kv", "f32"), r)
    print(f"budget {a.memory_budget or 'none (resident)'}; {len(prompts)} prompts, {a.max_tokens} new tokens each")
    print(f"{'':<44}{'tok/s':>8}{'x one':>7}{'TTFT med':>10}{'peak held':>11}  equal  plan")
    for r in singles + many + llama:
        ours = not r["draft"].startswith("llama")
        kv = f", --kv-dtype {r['kv']}" if ours and r.get("kv", "f32") != "f16" else ""
        label = f"{r['clients']} client(s), " + (
            f"--parallel {r['slots']}, --draft {r['draft']}{kv}" if ours else r["draft"]
        )
        ttft = statistics.median(x["ttft_s"] for x in r["rows"].values() if x["ttft_s"] is not None)
        peak = f"{r['peak_held'] / 2**20:.0f} MiB" if r["peak_held"] else "-"
        ref = first.get(r.get("kv", "f32")) if ours else None
        same = all(r["rows"][k]["text"] == ref["rows"][k]["text"] for k in ref["rows"]) if ref else "-"
        print(
            f"{label:<44}{r['tok_s']:>8.2f}{r['tok_s'] / best['tok_s']:>7.2f}{ttft:>9.2f}s{peak:>11}  {same!s:<5}  "
            f"{' | '.join(r['plan'])[:120]}"
        )


if __name__ == "__main__":
    main()
