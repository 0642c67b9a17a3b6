"""What transparent huge pages give a decode step (formats/store.py `weights_buffer`): two copies of one model's
weights in one process, one on plain 4 KiB pages (`CADENCE_HUGE_PAGES=0`), one on huge pages, their decode steps
alternating token by token, so that a host whose speed moves from minute to minute moves both alike. Each round
prefills 32 tokens into each copy's own KV cache, then runs `--steps` greedy decode steps on each; the figures are
each copy's median and fastest step and the ratio of the medians.

    python -m bench.huge_pages --model qwen2.5-coder-1.5b --dtype int4 --rounds 4
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch


def _load(store, huge: bool):
    from formats.loading import load_store
    from formats.store import huge_pages

    os.environ["CADENCE_HUGE_PAGES"] = "1" if huge else "0"
    huge_pages.cache_clear()
    try:
        model = load_store(store, tokenizer=False).model
    finally:
        os.environ.pop("CADENCE_HUGE_PAGES")
        huge_pages.cache_clear()
    model.kv_dtype = "f16"
    return model


class Decode:
    """One copy's generation: its cache, its last token and its steps' seconds."""

    def __init__(self, model, prompt: int = 32, whole: bool = False):
        """`whole`: each forward's rows said to be kept (`KVCache.whole`), as a generation's prefill and steps are."""
        from models.kvcache import KVCache

        self.model, self.cache, self.whole = model, KVCache(model.args, 512, dtype="f16"), whole
        self.cache.whole = whole
        out = model.forward(
            torch.arange(100, 100 + prompt), torch.arange(prompt), self.cache, logits_rows=slice(-1, None), argmax=True
        )
        self.cache.commit()
        self.token, self.pos, self.times = int(out[-1]), prompt, []

    def step(self) -> None:
        t0 = time.perf_counter()
        self.cache.whole = self.whole
        out = self.model.forward(torch.tensor([self.token]), torch.tensor([self.pos]), self.cache, argmax=True)
        self.cache.commit()
        self.times.append(time.perf_counter() - t0)
        self.token, self.pos = int(out[-1]), self.pos + 1


def main(argv=None) -> int:
    from formats.convert import ensure_store
    from formats.store import huge_pages
    from pulls.registry import DEFAULT_TARGET

    p = argparse.ArgumentParser(prog="python -m bench.huge_pages", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_TARGET, help="a model name, GGUF or HF directory (default: %(default)s)")
    p.add_argument("--dtype", default="int4")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=96)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    if not huge_pages():
        print("this kernel gives no transparent huge pages on request: nothing to compare", file=sys.stderr)
        return 1
    torch.set_num_threads(a.threads)
    store = ensure_store(a.model, a.dtype)
    plain, huge = _load(store, False), _load(store, True)
    print(f"{a.model} {a.dtype}, {a.threads} threads: decode step ms, the two copies alternating")
    print("| round | plain median | plain fastest | huge median | huge fastest | huge / plain |")
    print("|---:|---:|---:|---:|---:|---:|")
    ratios = []
    for r in range(a.rounds):
        x, y = Decode(plain), Decode(huge)
        for _ in range(a.steps):
            x.step()
            y.step()
        tx, ty = sorted(x.times[8:]), sorted(y.times[8:])  # (the first steps warm the caches)
        mx, my = tx[len(tx) // 2] * 1e3, ty[len(ty) // 2] * 1e3
        ratios.append(my / mx)
        print(f"| {r} | {mx:.2f} | {tx[0] * 1e3:.2f} | {my:.2f} | {ty[0] * 1e3:.2f} | {my / mx:.3f} |")
    print(f"huge / plain, median of the rounds: {sorted(ratios)[len(ratios) // 2]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
