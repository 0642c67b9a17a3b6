"""`launch runtime-bench` runs end to end (tiny sizes; the real run is in BENCHMARKS.md)."""

from __future__ import annotations

import argparse
import json

from bench import cmd_runtime_bench


def test_runtime_bench_smoke(tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="launch")
    cmd_runtime_bench.add_parser(parser.add_subparsers())
    out = tmp_path / "rb.json"
    args = parser.parse_args(
        ["runtime-bench", "--rounds", "50", "--max-mib", "0", "--memcpy-mib", "4", "--json", str(out)]
    )
    assert args.func(args) == 0
    res = json.loads(out.read_text())
    assert res["rtt"]["n"] == 50 and 0 < res["rtt"]["p50_us"] <= res["rtt"]["p99_us"]
    assert [h["bytes"] for h in res["handoff"]] == [4096]
    assert all(res["handoff"][0][k] > 0 for k in ("arena_us", "arena_put_us", "pickle_zmq_us"))
    assert res["memcpy"]["numpy_copyto_GBps"] > 0
    assert "| 4 KiB |" in capsys.readouterr().out
