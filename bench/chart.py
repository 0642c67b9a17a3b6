"""A picture of a benchmark: tokens/s per run and prompt kind, one chart per memory budget.

`launch bench --json OUT` writes it beside its rows (OUT with .html); several runs' rows (a bench
per budget, say) go into one page with

    python -m bench.chart ROWS.json [ROWS.json ...] -o chart.html

The page is self-contained (inline SVG and CSS, no script, no network): any browser opens it.
"""

from __future__ import annotations

import argparse
import html
import json
import sys
from collections import defaultdict
from pathlib import Path

from bench.report import LLAMA_CPP
from common.modes import Mode

COLORS = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1")
MiB = 1 << 20


def _label(row: dict) -> str:
    if row["mode"] == Mode.TREE and row.get("draft") is None and row.get("memory_budget_bytes"):
        return "tree (no draft)"
    return row["mode"] if row["mode"] == LLAMA_CPP or row.get("format") == "int4" else f"{row['mode']} {row['format']}"


def _budget(row: dict) -> str:
    b = row.get("memory_budget_bytes")
    if not b:
        return "no memory limit"
    return f"{b / 2**30:.2f} GiB memory limit" if b >= 2**30 else f"{b / MiB:.0f} MiB memory limit"


def _rate(rows: list[dict]) -> float:
    wall = sum(r["wall_s"] for r in rows)
    return sum(len(r["new_token_ids"]) for r in rows) / wall if wall else 0.0


def chart_svg(rows: list[dict], title: str) -> str:
    """Grouped bars: one group per run, one bar per prompt kind and one for all of them."""
    kinds = list(dict.fromkeys(r["kind"] for r in rows)) + ["all"]
    runs = list(dict.fromkeys(_label(r) for r in rows))
    rate = {
        (run, k): _rate([r for r in rows if _label(r) == run and (k == "all" or r["kind"] == k)])
        for run in runs
        for k in kinds
    }
    top = max(rate.values(), default=1.0) or 1.0
    bar, gap, left, h, base = 18, 26, 56, 260, 300
    width = left + len(runs) * (len(kinds) * bar + gap) + 20
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{base + 70}" role="img" aria-label="{html.escape(title)}">',
        f'<text x="{left}" y="20" class="title">{html.escape(title)}</text>',
    ]
    for i in range(5):  # the value axis: 4 gridlines
        v = top * i / 4
        y = base - h * i / 4
        out.append(
            f'<line x1="{left - 4}" x2="{width - 10}" y1="{y:.1f}" y2="{y:.1f}" class="grid"/>'
            f'<text x="{left - 8}" y="{y + 4:.1f}" class="axis" text-anchor="end">{v:.1f}</text>'
        )
    x = left + gap / 2
    for run in runs:
        for j, k in enumerate(kinds):
            v = rate[(run, k)]
            bh = h * v / top
            cls = "bar all" if k == "all" else "bar"
            out.append(
                f'<rect x="{x:.1f}" y="{base - bh:.1f}" width="{bar - 2}" height="{bh:.1f}" fill="{COLORS[j % len(COLORS)]}" '
                f'class="{cls}" data-run="{html.escape(run)}" data-kind="{k}" data-value="{v:.3f}">'
                f"<title>{html.escape(run)}, {k}: {v:.2f} tok/s</title></rect>"
            )
            if k == "all":
                out.append(
                    f'<text x="{x + bar / 2:.1f}" y="{base - bh - 4:.1f}" class="value" text-anchor="middle">{v:.2f}</text>'
                )
            x += bar
        cx = x - len(kinds) * bar / 2
        out.append(f'<text x="{cx:.1f}" y="{base + 18}" class="run" text-anchor="middle">{html.escape(run)}</text>')
        x += gap
    lx = left
    for j, k in enumerate(kinds):
        out.append(
            f'<rect x="{lx}" y="{base + 38}" width="12" height="12" fill="{COLORS[j % len(COLORS)]}"/>'
            f'<text x="{lx + 16}" y="{base + 48}" class="legend">{html.escape(k)}</text>'
        )
        lx += 16 + 8 * len(k) + 18
    out.append(
        f'<text x="14" y="{base - h / 2:.0f}" class="axis" transform="rotate(-90 14 {base - h / 2:.0f})" '
        f'text-anchor="middle">tokens/s</text></svg>'
    )
    return "\n".join(out)


def page(rows: list[dict], title: str = "cadence benchmark") -> str:
    by_budget: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        by_budget[_budget(r)].append(r)
    charts = [f"<figure>{chart_svg(rs, budget)}</figure>" for budget, rs in by_budget.items()]
    models = sorted({f"{r['target']} ({r['format']})" for r in rows if r["mode"] != LLAMA_CPP})
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 24px; color: #222; }}
figure {{ margin: 0 0 24px 0; }}
.title {{ font-size: 15px; font-weight: 600; }}
.axis, .legend, .run {{ font-size: 12px; fill: #444; }}
.value {{ font-size: 11px; fill: #222; }}
.grid {{ stroke: #ddd; stroke-width: 1; }}
.bar.all {{ stroke: #222; stroke-width: 1; }}
</style></head>
<body><h1>{html.escape(title)}</h1>
<p>tokens per second (generated tokens over generation time, model loading excluded), per prompt kind and over
all prompts (outlined); {html.escape(", ".join(models))}; {len(rows)} rows.</p>
{"".join(charts)}
</body></html>
"""


def write_chart(rows: list[dict], path: str | Path, title: str = "cadence benchmark") -> Path:
    path = Path(path)
    path.write_text(page(rows, title))
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.chart", description=__doc__.split("\n")[0])
    p.add_argument("rows", nargs="+", help="JSON rows written by launch bench --json (or launch run --json)")
    p.add_argument("-o", "--out", required=True, help="the HTML page to write")
    p.add_argument("--title", default="cadence benchmark")
    a = p.parse_args(argv)
    rows = []
    for f in a.rows:
        try:
            got = json.loads(Path(f).read_text())
        except (OSError, json.JSONDecodeError) as e:
            print(f"bench.chart: cannot read {f} ({e}); give the rows launch bench --json wrote", file=sys.stderr)
            return 1
        if not isinstance(got, list) or not all(isinstance(r, dict) and "new_token_ids" in r for r in got):
            print(f"bench.chart: {f} holds no benchmark rows; give the rows launch bench --json wrote", file=sys.stderr)
            return 1
        rows += got
    print(write_chart(rows, a.out, a.title))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
