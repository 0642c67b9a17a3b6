"""A hybrid's decode step as it ran before and as it runs now, one model, two generations whose steps alternate
token by token, so that a host whose speed moves from minute to minute moves both alike. Before: a Mamba-2 branch
in its separate calls, each recurrent layer's end state written into its second buffer, a scaled head (Granite's)
folded part by part in torch. Now: the branch in one kernel call (models/recurrent_kernels.py `ssm_layer`), the
state stepped in place where the step's row is sure to be kept (`KVCache.whole`), the head's scale divided in its
argmax kernel. Each round prefills 32 tokens into each generation's own cache, then runs `--steps` greedy decode
steps on each; the figures are each one's median and fastest step and the ratio of the medians. Both give the same
tokens (checked).

    python -m bench.hybrid_step --model /work/synth2/granitehybrid-q4_k_m.gguf --rounds 4
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench.huge_pages import Decode


class _Way:
    """The model's Mamba-2 layers and head as one way runs them: `use()` before each of its steps."""

    def __init__(self, model, now: bool):
        import models.transformer as tr
        from models import recurrent_kernels as rk
        from models.sampling import HeadArgmax

        a = model.args
        self.layers = [model.weights.layer(i) for i in a.rec_layers] if a.rec_kind == "ssm" else []
        self.records = [rk.ssm_record(w, a) if now else torch.empty(0, dtype=torch.int64) for w in self.layers]
        self.head = HeadArgmax if now else lambda rows, dev, plain, div: HeadArgmax(rows, dev, plain and div == 1.0)
        self.tr, self.now = tr, now

    def use(self) -> None:
        for w, rec in zip(self.layers, self.records):
            w.ssm_record = rec if rec is not None else torch.empty(0, dtype=torch.int64)
        self.tr.HeadArgmax = self.head


def main(argv=None) -> int:
    from formats.convert import ensure_store
    from formats.loading import load_store

    p = argparse.ArgumentParser(prog="python -m bench.hybrid_step", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a hybrid's GGUF, HF directory or weight store")
    p.add_argument("--dtype", default="int4")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    model = load_store(ensure_store(a.model, a.dtype), tokenizer=False).model
    model.kv_dtype = "f16"
    ways = [_Way(model, False), _Way(model, True)]
    print(f"{a.model} {a.dtype}, {a.threads} threads: decode step ms, before and now alternating")
    print("| round | before median | before fastest | now median | now fastest | now / before |")
    print("|---:|---:|---:|---:|---:|---:|")
    ratios = []
    for r in range(a.rounds):
        gens = []
        for way in ways:
            way.use()
            gens.append(Decode(model, whole=way.now))
        tokens = [[], []]
        for _ in range(a.steps):
            for way, gen, seen in zip(ways, gens, tokens):
                way.use()
                gen.step()
                seen.append(gen.token)
        if tokens[0] != tokens[1]:
            print("the two ways gave different tokens", file=sys.stderr)
            return 1
        tx, ty = (sorted(g.times[8:]) for g in gens)  # (the first steps warm the caches)
        mx, my = tx[len(tx) // 2] * 1e3, ty[len(ty) // 2] * 1e3
        ratios.append(my / mx)
        print(f"| {r} | {mx:.2f} | {tx[0] * 1e3:.2f} | {my:.2f} | {ty[0] * 1e3:.2f} | {my / mx:.3f} |")
    ways[1].use()
    print(f"now / before, median of the rounds: {sorted(ratios)[len(ratios) // 2]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
