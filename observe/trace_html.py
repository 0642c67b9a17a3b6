"""`launch trace html`: one self-contained HTML file that draws a Chrome trace.

The viewer (`observe/trace_viewer.html`: vanilla JS on a canvas, no network, nothing
fetched) gets the trace inlined as a JSON script element: a track per actor process and thread,
spans coloured by category, counters as line charts, flow arrows, wheel zoom, drag pan, and a
click on a span shows its args. It exposes `window.viewer` (track list, span counts, `setView`,
`spanScreenRect`) for the browser test.
"""

from __future__ import annotations

import html
import json
from importlib import resources
from pathlib import Path

from observe.traces import load_trace

_TITLE, _DATA = "__TITLE__", "__TRACE_JSON__"


def viewer_template() -> str:
    return resources.files("observe").joinpath("trace_viewer.html").read_text(encoding="utf-8")


def render_html(trace: dict | list, title: str = "cadence trace") -> str:
    """The viewer page with `trace` inside. `<` is escaped in the JSON, so no string in the trace
    can close the script element."""
    data = json.dumps(trace, separators=(",", ":"), allow_nan=False).replace("<", "\\u003c")
    page = viewer_template()
    head, sep, tail = page.partition(_DATA)
    if not sep:
        raise RuntimeError("the trace viewer template has no data placeholder")
    return head.replace(_TITLE, html.escape(title)) + data + tail


def write_html(trace_path, out_path=None, title: str | None = None) -> Path:
    """Write the viewer for the trace file at `trace_path`; default: next to it, as .html."""
    trace_path = Path(trace_path)
    out = Path(out_path) if out_path else trace_path.with_suffix(".html")
    trace = load_trace(trace_path)
    run_id = trace.get("otherData", {}).get("run_id") if isinstance(trace, dict) else None
    page = render_html(trace, title or f"cadence trace {run_id or trace_path.stem}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(out)
    return out
