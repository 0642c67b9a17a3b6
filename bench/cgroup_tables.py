"""`launch bench --cgroup`'s tables (bench/in_cgroup.py runs each mode in its cgroup): tokens/s per prompt kind and
the ratios to `stdpl` and to llama.cpp, the disk's figures of the streamed modes, memory against each run's limit
and plan, and a mixture of experts' buffer by policy."""

from __future__ import annotations

from common.modes import Mode
from bench.report import LLAMA_CPP, label

MiB = 1 << 20


def tokens_per_s(rs: list[dict]) -> float:
    wall = sum(r["wall_s"] for r in rs)
    return sum(len(r["new_token_ids"]) for r in rs) / wall if wall else 0.0


def tables(rows: list[dict], runs: list) -> dict:
    names = list(dict.fromkeys(label(r) for r in rows))
    out = {
        "tokens/s under the limit": speed_table(rows, names),
        "streaming": stream_table(rows, names),
        "memory": memory_table(rows, runs),
    }
    experts = experts_table(rows, names)
    if len(experts) > 1:
        out["experts"] = experts
    return out


def speed_table(rows: list[dict], names: list[str]) -> list[list]:
    kinds = list(dict.fromkeys(r["kind"] for r in rows))
    rate = {
        (n, k): tokens_per_s([r for r in rows if label(r) == n and (k == "all" or r["kind"] == k)])
        for n in names
        for k in [*kinds, "all"]
    }
    first = next((n for n in names if n != LLAMA_CPP), Mode.STDPL)
    ref = (
        Mode.STDPL if Mode.STDPL in names else first
    )  # a mixture of experts: its first variant (on demand, where it ran)
    out = [["run", *kinds, "all", f"/ {ref}", "/ llama.cpp", "accepted / verification"]]
    for n in names:
        rs = [r for r in rows if label(r) == n]
        ver = sum(r["stats"].get("verifications", 0) for r in rs)
        acc = sum(r["stats"].get("accepted", 0) for r in rs)

        def ratio(to: str) -> str:
            return f"{rate[(n, 'all')] / rate[(to, 'all')]:.2f}x" if rate.get((to, "all")) else "-"

        out.append(
            [
                n,
                *[f"{rate[(n, k)]:.2f}" for k in kinds],
                f"{rate[(n, 'all')]:.2f}",
                ratio(ref),
                ratio("llama.cpp"),
                f"{acc / ver:.2f}" if ver else "",
            ]
        )
    return out


def stream_table(rows: list[dict], names: list[str]) -> list[list]:
    out = [["run", "read GB/s", "loader busy % of wall", "verifier waits on I/O % of wall", "MB read / token (all)"]]
    for n in names:
        rs = [r for r in rows if label(r) == n]
        wall, toks = sum(r["wall_s"] for r in rs), sum(len(r["new_token_ids"]) for r in rs)
        byt, rd, wait = (sum(r["stats"].get(k, 0) for r in rs) for k in ("bytes_read", "read_s", "io_wait_s"))
        # a flash draft's own reads (its bundles, its prompt pass's dense FFNs) count in the bytes per token
        byt_all = byt + sum(f["bundle_bytes"] + f["dense_bytes"] for r in rs if (f := r["stats"].get("draft_flash")))
        if rd:
            out.append(
                [
                    n,
                    f"{byt / rd / 1e9:.2f}",
                    f"{100 * rd / wall:.0f}",
                    f"{100 * wait / wall:.0f}",
                    f"{byt_all / toks / 1e6:.0f}",
                ]
            )
    return out


def memory_table(rows: list[dict], runs: list) -> list[list]:
    out = [
        [
            "run",
            "limit MiB",
            "cgroup peak MiB",
            "held peak MiB (anon + shmem)",
            "plan held MiB",
            "OOM kill",
            "exit",
            "held by process near the peak (MiB)",
        ]
    ]
    for name, run, limit in runs:
        plan = next((r.get("memory_plan", {}).get("held_bytes") for r in rows if label(r) == name), None)
        held = sorted((run.held_by_process or {}).items(), key=lambda x: -x[1])
        procs = ", ".join(f"{p.removeprefix('cad-')} {b / MiB:.0f}" for p, b in held)
        out.append(
            [
                name,
                f"{limit / MiB:.0f}",
                f"{run.peak_bytes / MiB:.0f}",
                f"{run.peak_held_bytes / MiB:.0f}",
                f"{plan / MiB:.0f}" if plan else "-",
                "yes" if run.oom_killed else "no",
                str(run.returncode),
                procs,
            ]
        )
    return out


def experts_table(rows: list[dict], names: list[str]) -> list[list]:
    out = [
        [
            "run",
            "hit rate",
            "preloads",
            "of them used",
            "expert reads / token",
            "expert MB read / token",
            "waits on experts % of wall",
        ]
    ]
    for n in names:
        rs = [r for r in rows if label(r) == n and "expert_requests" in r["stats"]]
        if not rs:
            continue
        g = {
            k: sum(r["stats"].get(k, 0) for r in rs)
            for k in (
                "expert_hits",
                "expert_misses",
                "expert_preloads",
                "expert_preload_hits",
                "expert_reads",
                "expert_bytes_read",
                "expert_wait_s",
            )
        }
        toks, wall = sum(len(r["new_token_ids"]) for r in rs), sum(r["wall_s"] for r in rs)
        asked = g["expert_hits"] + g["expert_misses"]
        out.append(
            [
                n,
                f"{g['expert_hits'] / asked:.3f}" if asked else "-",
                str(g["expert_preloads"]),
                str(g["expert_preload_hits"]),
                f"{g['expert_reads'] / toks:.1f}",
                f"{g['expert_bytes_read'] / toks / 1e6:.0f}",
                f"{100 * g['expert_wait_s'] / wall:.0f}",
            ]
        )
    return out
