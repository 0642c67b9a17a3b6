"""`launch trace html`: one self-contained page, checked in a real headless Chromium: the tracks
and spans it draws match the trace, wheel and drag move the view, a click shows a span's args,
and a screenshot of it is a real picture. Skips only where no Chromium is installed
(.ci/install-browser.sh installs it, its driver and selenium)."""

from __future__ import annotations

import json
import re
import struct
import zlib
from collections import Counter
from pathlib import Path


from observe.trace_html import render_html, write_html


def test_page_is_self_contained_and_escapes_the_trace():
    trace = {
        "traceEvents": [
            {
                "ph": "X",
                "pid": 1,
                "tid": 1,
                "ts": 0,
                "dur": 5,
                "name": "</script><script>alert(1)</script>",
                "args": {"note": "<!-- -->"},
            }
        ]
    }
    page = render_html(trace, title="a <title>")
    assert not re.search(r"https?://|<link\b|\bsrc\s*=|@import|url\(", page, re.I)  # nothing fetched, ever
    assert page.count("<script") == 2 and "</script><script>alert" not in page
    assert "<title>a &lt;title&gt;</title>" in page
    data = re.search(r'<script id="trace-data" type="application/json">(.*?)</script>', page, re.S).group(1)
    assert json.loads(data) == trace


def _expected(trace: dict):
    evs = trace["traceEvents"]
    threads = Counter((e["pid"], e["tid"]) for e in evs if e["ph"] == "X")
    counters = Counter((e["pid"], e["name"]) for e in evs if e["ph"] == "C")
    flows = Counter((e.get("cat"), e["id"]) for e in evs if e["ph"] in "sf")
    return threads, counters, flows


def _in_view(trace: dict, t0: float, t1: float) -> int:
    return sum(1 for e in trace["traceEvents"] if e["ph"] == "X" and e["ts"] <= t1 and e["ts"] + e["dur"] >= t0)


def test_viewer_draws_the_trace_zooms_pans_and_shows_args_on_click(browser, fake_trace, tmp_path):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.actions.action_builder import ActionBuilder
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    trace = fake_trace.trace
    page = write_html(fake_trace.path, tmp_path / "run.html")
    browser.get(page.as_uri())
    WebDriverWait(browser, 30).until(lambda d: d.execute_script("return !!(window.viewer && window.viewer.ready)"))
    errors = [m for m in browser.get_log("browser") if m["level"] == "SEVERE"]
    assert not errors, errors

    # a track per (process, thread) with spans and per (process, counter); every span and flow drawn
    threads, counters, flows = _expected(trace)
    tracks = browser.execute_script("return viewer.tracks()")
    assert {(t["pid"], t["tid"]): t["spans"] for t in tracks if t["kind"] == "thread"} == dict(threads)
    assert {(t["pid"], t["name"]): t["points"] for t in tracks if t["kind"] == "counter"} == dict(counters)
    assert {"memory", "alpha", "tokens"} <= {name for _, name in counters}
    stats = browser.execute_script("return viewer.stats")
    n_spans = sum(threads.values())
    assert stats["tracks"] == len(threads) + len(counters) and stats["threadTracks"] == len(threads)
    assert stats["spans"] == stats["drawnSpans"] == n_spans
    assert stats["flows"] == stats["drawnFlows"] == sum(1 for c in flows.values() if c == 2)
    tree_flows = browser.execute_script("return viewer.model.flows.filter(f => f.cat === 'tree').length")
    assert tree_flows == fake_trace.rounds  # an arrow from each draft tree to its verification
    assert browser.find_element(By.ID, "stats").text.startswith(
        f"{len(threads)} thread tracks, {len(counters)} counters, {n_spans} of {n_spans} spans"
    )

    # zoom to the middle fifth: exactly the spans that overlap it are drawn
    home = browser.execute_script("return [viewer.home.t0, viewer.home.t1]")
    a, b = home[0] + 0.4 * (home[1] - home[0]), home[0] + 0.6 * (home[1] - home[0])
    browser.execute_script("viewer.setView(arguments[0], arguments[1])", a, b)
    drawn = browser.execute_script("return viewer.stats.drawnSpans")
    assert drawn == _in_view(trace, a, b) and 0 < drawn < n_spans

    # real input: the wheel zooms in around the pointer, a drag pans
    canvas = browser.find_element(By.ID, "tracks")
    view = lambda: browser.execute_script("return [viewer.view.t0, viewer.view.t1]")
    before = view()
    ActionChains(browser).scroll_to_element(canvas).perform()
    ActionChains(browser).scroll_from_origin(_origin(canvas), 0, -300).perform()
    after = view()
    assert after[1] - after[0] < 0.9 * (before[1] - before[0])
    ActionChains(browser).move_to_element(canvas).click_and_hold().move_by_offset(-200, 0).release().perform()
    panned = view()
    assert panned[0] > after[0] and abs((panned[1] - panned[0]) - (after[1] - after[0])) < 1e-6 * (after[1] - after[0])

    # click a layer span (a streamed group the verifier computed): the panel shows its args
    vpid = fake_trace.pids["verifier"]
    span = next(
        e
        for e in trace["traceEvents"][len(trace["traceEvents"]) // 2 :]
        if e["ph"] == "X" and e["pid"] == vpid and e["name"] == "layer"
    )
    browser.execute_script(
        "viewer.setView(arguments[0], arguments[1])", span["ts"] - span["dur"], span["ts"] + 2 * span["dur"]
    )
    r = browser.execute_script(
        "return viewer.spanScreenRect(arguments[0], arguments[1], arguments[2])", vpid, span["tid"], span["ts"]
    )
    browser.execute_script(
        "document.getElementById('scroller').scrollTop = Math.max(0, arguments[0] - 40)", r["trackY"]
    )
    r = browser.execute_script(
        "return viewer.spanScreenRect(arguments[0], arguments[1], arguments[2])", vpid, span["tid"], span["ts"]
    )
    assert r["w"] > 100  # a third of the timeline
    click = ActionBuilder(browser)
    click.pointer_action.move_to_location(int(r["x"] + r["w"] / 2), int(r["y"] + r["h"] / 2)).click()
    click.perform()
    shown = json.loads(browser.find_element(By.ID, "args-json").text)
    assert shown == span["args"] and shown["req"] > 0
    details = browser.find_element(By.ID, "args").text
    assert "layer" in details and f"pid {vpid}" in details

    # a screenshot: a real picture with the categories' colours in it
    shot = tmp_path / "viewer.png"
    assert browser.save_screenshot(str(shot))
    width, height, pixels = read_png(shot)
    assert (width, height) == tuple(browser.execute_script("return [window.innerWidth, window.innerHeight]"))
    colours = Counter(pixels)
    assert len(colours) > 50 and colours.most_common(1)[0][1] < 0.9 * width * height
    assert colours[(0xEF, 0x44, 0x44)] > 200  # the verifier's red spans
    print(f"screenshot: {shot}")


def _origin(element):
    from selenium.webdriver.common.actions.wheel_input import ScrollOrigin

    return ScrollOrigin.from_element(element)


def read_png(path: Path) -> tuple[int, int, list[tuple[int, int, int]]]:
    """Width, height and RGB pixels of an 8-bit RGB/RGBA PNG (what Chromium writes)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat = 8, b""
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos : pos + 8])
        body = data[pos + 8 : pos + 8 + n]
        if kind == b"IHDR":
            width, height, depth, ctype, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert depth == 8 and ctype in (2, 6) and interlace == 0, (depth, ctype, interlace)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    bpp = 3 if ctype == 2 else 4
    raw, stride = zlib.decompress(idat), width * bpp
    prev, pixels = bytearray(stride), []
    for y in range(height):
        f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for i in range(stride):
            left = line[i - bpp] if i >= bpp else 0
            up, ul = prev[i], prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + left) & 255
            elif f == 2:
                line[i] = (line[i] + up) & 255
            elif f == 3:
                line[i] = (line[i] + (left + up) // 2) & 255
            elif f == 4:
                p = left + up - ul
                pa, pb, pc = abs(p - left), abs(p - up), abs(p - ul)
                line[i] = (line[i] + (left if pa <= pb and pa <= pc else up if pb <= pc else ul)) & 255
        pixels += [tuple(line[i : i + 3]) for i in range(0, stride, bpp)]
        prev = line
    return width, height, pixels
