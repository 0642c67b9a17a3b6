"""What a KV cache's dtype costs in quality (issue 57): the target's perplexity over held-out texts with its caches
in f32, f16 and q8 (`--kv-dtype`), and how often its greedy choice at each position is the f32 caches' choice.

The texts are not in the prompt sets: three modules of Python's own standard library (code, the default models'
kind) and this repository's design notes (prose), the first `--tokens` tokens of each. Each text runs through the
model in chunks of 256 rows, every row attending over the cache as written so far (so its own rows too, in the
cache's dtype).

    python -m bench.kv_quality --target qwen2.5-coder-1.5b --dtype int4 --tokens 1024
"""

from __future__ import annotations

import argparse
import math
import sys
import sysconfig
from pathlib import Path

import torch

CHUNK = 256
REPO = Path(__file__).resolve().parents[1]


def texts() -> dict[str, str]:
    lib = Path(sysconfig.get_paths()["stdlib"])
    out = {name: (lib / name).read_text() for name in ("textwrap.py", "heapq.py", "fractions.py")}
    notes = REPO.parent / "shared" / "design" / "ARCHITECTURE.md"
    out["ARCHITECTURE.md"] = notes.read_text() if notes.exists() else (REPO / "README.md").read_text()
    return out


def score(lm, ids: list[int], kv: str) -> tuple[float, list[int]]:
    """(summed negative log-likelihood of ids[1:], the greedy choice at each position) with `kv` caches."""
    model = lm.model
    model.kv_dtype = kv
    cache = model.new_cache(len(ids))
    nll, choice = 0.0, []
    with torch.inference_mode():
        for s in range(0, len(ids) - 1, CHUNK):
            chunk = torch.tensor(ids[s : s + CHUNK])
            logits = model.forward(chunk, torch.arange(s, s + len(chunk)), cache)
            cache.commit()
            logp = torch.log_softmax(logits.float(), dim=-1)
            nxt = torch.tensor(ids[s + 1 : s + 1 + len(chunk)])
            n = len(nxt)
            nll -= float(logp[torch.arange(n), nxt].sum())
            choice += logp[:n].argmax(-1).tolist()
    model.kv_dtype = "f32"
    return nll, choice


def main(argv=None) -> None:
    from formats import loading

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b")
    p.add_argument("--dtype", default="int4")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--kv-dtypes", default="f32,f16,q8")
    a = p.parse_args(argv)
    lm = loading.load(a.target, a.dtype)
    kvs = a.kv_dtypes.split(",")
    rows = {kv: [0.0, 0, 0] for kv in kvs}  # nll, positions, greedy choices equal to f32's
    print(f"{a.target} {a.dtype}; {a.tokens} tokens of each text; perplexity (greedy choices equal to f32's)")
    for name, text in texts().items():
        ids = lm.tokenizer.encode(text)[: a.tokens]
        got = {kv: score(lm, ids, kv) for kv in kvs}
        ref = got[kvs[0]][1]
        line = []
        for kv, (nll, choice) in got.items():
            same = sum(x == y for x, y in zip(choice, ref))
            rows[kv][0] += nll
            rows[kv][1] += len(choice)
            rows[kv][2] += same
            line.append(f"{kv} {math.exp(nll / len(choice)):.4f} ({same / len(choice):.2%})")
        print(f"  {name:<18} " + "  ".join(line), flush=True)
    print("| KV dtype | perplexity | / f32 | greedy choice = f32's |")
    print("|---|---:|---:|---:|")
    base = math.exp(rows[kvs[0]][0] / rows[kvs[0]][1])
    for kv, (nll, n, same) in rows.items():
        ppl = math.exp(nll / n)
        print(f"| {kv} | {ppl:.4f} | {ppl / base:.4f} | {same / n:.2%} |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
