"""What a new KV cache's pages cost a prompt (models/kvcache.py `zero_pages`): a prefill into a new cache whose
zeros are written over the whole context first (`torch.zeros`, as before), against one whose pages the kernel
zero-fills as the forward first writes them, alternating in one process so that a host whose speed moves moves
both alike. Each figure is a new cache and its prompt's prefill, in ms; medians and fastest of `--rounds`.

    python -m bench.kv_pages --model qwen2.5-coder-1.5b --prompt 36 --context 2048
"""

from __future__ import annotations

import argparse
import sys
import time

import torch


def main(argv=None) -> int:
    import models.kvcache as kv
    from formats.convert import ensure_store
    from formats.loading import load_store
    from pulls.registry import DEFAULT_TARGET

    p = argparse.ArgumentParser(prog="python -m bench.kv_pages", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_TARGET, help="a model name, GGUF or HF directory (default: %(default)s)")
    p.add_argument("--dtype", default="int4")
    p.add_argument("--prompt", type=int, default=36, help="the prompt's tokens")
    p.add_argument("--context", type=int, default=2048, help="the cache's tokens")
    p.add_argument("--kv-dtype", default="f16")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    model = load_store(ensure_store(a.model, a.dtype), tokenizer=False).model
    model.kv_dtype = a.kv_dtype
    ways = {"zeros written": lambda n: torch.zeros(n, dtype=torch.uint8), "zero pages": kv.zero_pages}

    def prefill(alloc) -> float:
        kv.zero_pages = alloc
        t0 = time.perf_counter()
        cache = kv.KVCache(model.args, a.context, dtype=a.kv_dtype)
        tokens = torch.arange(100, 100 + a.prompt)
        model.forward(tokens, torch.arange(a.prompt), cache, logits_rows=slice(-1, None), argmax=True)
        return (time.perf_counter() - t0) * 1e3

    times = {name: [] for name in ways}
    for name, alloc in ways.items():  # (a warm-up each)
        prefill(alloc)
    for _ in range(a.rounds):
        for name, alloc in ways.items():
            times[name].append(prefill(alloc))
    mib = kv.KVCache.numel(model.args, a.context, a.kv_dtype) * 4 / 2**20
    print(f"{a.model} {a.dtype}: a {a.prompt}-token prompt into a new {a.context}-token cache ({mib:.0f} MiB)")
    for name, ts in times.items():
        ts.sort()
        print(f"  {name:<14} median {ts[len(ts) // 2]:7.1f} ms   fastest {ts[0]:7.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
