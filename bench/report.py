"""What `launch bench` prints: tokens/s per mode and prompt kind with ratios, and the suites' tables."""

from __future__ import annotations

from collections import defaultdict

from rich.console import Console
from rich.table import Table

from common.modes import Mode

LLAMA_CPP = "llama.cpp"  # a row of llama.cpp's: its `mode` names the engine, not a mode of ours


def print_table(console: Console, title: str, table: list[list]) -> None:
    """A table on the terminal; piped, as Markdown with nothing cut (BENCHMARKS.md takes it as it is)."""
    if not console.is_terminal:
        print(f"\n{title}\n")
        print("| " + " | ".join(str(c) for c in table[0]) + " |")
        print("|" + "---|" * len(table[0]))
        for r in table[1:]:
            print("| " + " | ".join(str(x) for x in r) + " |")
        return
    t = Table(title=title)
    for c in table[0]:
        t.add_column(str(c))
    for r in table[1:]:
        t.add_row(*[str(x) for x in r])
    console.print(t)


def _rates(rows: list[dict]) -> tuple[dict, list[str]]:
    groups: dict[tuple, list] = defaultdict(list)
    for r in rows:
        if r.get("error"):
            continue
        for kind in (r["kind"], "all"):
            groups[(r["mode"], r["format"], r["target"], kind)].append(r)
    kinds = sorted({k[3] for k in groups} - {"all"}) + ["all"]
    rate = {
        k: sum(len(r["new_token_ids"]) for r in v) / max(sum(r["wall_s"] for r in v), 1e-9) for k, v in groups.items()
    }
    return {"groups": groups, "rate": rate}, kinds


def summary_table(rows: list[dict]) -> list[list]:
    """tokens/s (total tokens / total time) per mode and prompt kind, ratio to `target` (same weights)."""
    g, kinds = _rates(rows)
    groups, rate = g["groups"], g["rate"]
    out = [["mode", "format", "model", *kinds, "acc/verif", "verif/token", "wasted/token", "ahead reused/verif"]]
    for mode, fmt, target in sorted({k[:3] for k in groups}, key=lambda x: (x[2], x[1], x[0])):
        cells = []
        for kind in kinds:
            r, base = rate.get((mode, fmt, target, kind)), rate.get(("target", fmt, target, kind))
            cells.append(
                "" if r is None else f"{r:.2f}" + (f" ({r / base:.2f}x)" if base and mode != Mode.TARGET else "")
            )
        every = groups[(mode, fmt, target, "all")]
        n = sum(len(r["new_token_ids"]) for r in every)
        st = {
            k: sum(r["stats"].get(k, 0) for r in every) for k in ("verifications", "accepted", "wasted", "ahead_reused")
        }
        ver = max(st["verifications"], 1)
        spec = mode in (Mode.CHAIN, Mode.TREE)
        out.append(
            [
                mode,
                fmt,
                target,
                *cells,
                *(
                    (
                        f"{st['accepted'] / ver:.2f}",
                        f"{st['verifications'] / max(n, 1):.3f}",
                        f"{st['wasted'] / max(n, 1):.2f}",
                        f"{st['ahead_reused'] / ver:.2f}",
                    )
                    if spec
                    else ("", "", "", "")
                ),
            ]
        )
    return out


def failures(rows: list[dict]) -> list[str]:
    """One line per engine that could not run a prompt, the reason once."""
    seen, out = set(), []
    for r in rows:
        if r.get("error") and (r["mode"], r["error"]) not in seen:
            seen.add((r["mode"], r["error"]))
            n = sum(1 for x in rows if x["mode"] == r["mode"] and x.get("error") == r["error"])
            out.append(f"{r['mode']}: {n} prompt(s) without a result: {r['error']}")
    return out


def label(row: dict) -> str:
    """A row's run: the run it came from (tree mode whose `auto` draft settled on none stays `tree`); else its
    mode, `nodraft` for tree with no draft model, and a mixture of experts' buffer policies."""
    if row.get("run"):
        return row["run"]
    mode = row["mode"]
    if mode == Mode.TREE and row.get("draft") in (None, "flash"):
        mode = "nodraft" if row.get("draft") is None else "fdraft"
    return f"{mode}/{row['experts']}" if row.get("experts") and row["mode"] != LLAMA_CPP else mode


def lossless(rows: list[dict]) -> dict:
    """Per run: did it give std's token ids (stdpl's when std did not run; the first run of a mixture of
    experts) on every prompt? A run with half KV caches (`tree:f16`) against the same at f16 (`stdpl:f16`)."""
    out: dict[str, list[bool]] = {}
    for kv in dict.fromkeys(label(r).partition(":")[2] for r in rows if r["mode"] != LLAMA_CPP):
        at = [r for r in rows if r["mode"] != LLAMA_CPP and label(r).partition(":")[2] == kv]
        names = list(dict.fromkeys(label(r).partition(":")[0] for r in at))
        ref_mode = Mode.STD if Mode.STD in names else Mode.STDPL if Mode.STDPL in names else names[0]
        ref_mode += f":{kv}" if kv else ""
        ref = {r["id"]: r["new_token_ids"] for r in at if label(r) == ref_mode}
        for r in at:
            if label(r) != ref_mode and r["id"] in ref and not r.get("approximate"):
                out.setdefault(label(r), []).append(r["new_token_ids"] == ref[r["id"]])
    return {m: all(v) for m, v in out.items()}
