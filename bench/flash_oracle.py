"""An oracle bound on `--draft flash` with a neuron cache refreshed from the verifier (issue 26), teacher-forced.

    python -m bench.flash_oracle [--capacities 1792,2688,4480] [--k-in 0.3] [--variants dense,A,B,T] [--widths 16]
                                 [--tokens 48] [--limit 0] [--baseline int4:32768]

The draft is the 1.5B target itself (attention dense, its full output head); each layer's FFN is computed densely
and every neuron outside the layer's allowed set S is zeroed before `down` (the sparse FFN over S, up to
rounding). The cache of a layer: the C neurons most recently among a processed token's top `k_in` by the target's
TRUE |silu(gate.h) * up.h| (ties: the larger |a| at that token first). Before each tree it holds exactly the
tokens the target has run: the prompt, then each verification's root and accepted tokens (not the bonus token:
the target runs it first in the next verification). (A) S = the cache; (B) S = the cache and the int2
predictor's top round(0.3 * ffn) of the row; `dense`: S = every neuron (the target drafting itself). A draft
forward of more than DENSE_ROWS rows (its prompt window) is dense, as the flash draft's is. The true activations
come from one dense forward of the target over prompt + continuation, checked against the target's own logits.
The 0.5B draft (`--baseline`) runs through the same loop (bench/tree_growth.py `accepted`).
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.flash_quality import continuation
from bench.tree_growth import PROMPTS, accepted
from common.settings import TreeConfig
from engine.config import RunConfig
from engine.prompts import load_prompts
from engine.inputs import read_inputs
from engine.machine import ThisMachine
from models import kernels
from formats import loading
from formats.convert import ensure_store
from models import flash_records as records
from flash.sparse_target import with_ffn
from flash.predictor import Predictor
from flash.weights import DENSE_ROWS
from models.transformer import Transformer
from formats.weights import LayerWeights


class Shared:
    """A weight provider over a resident target's weights: each layer's attention and norms the target's own
    tensors, its FFN `ffn(i, gate_up, down)` (a callable (h, x) adding into x); everything else the target's."""

    def __init__(self, target, n_layers: int, ffn):
        self.target = target
        self.layers = [with_ffn(t, ffn(i, t.gate_up, t.down)) for i, t in enumerate(map(target.layer, range(n_layers)))]

    def layer(self, i: int) -> LayerWeights:
        return self.layers[i]

    def __getattr__(self, name):  # head_groups, head_part, embed, head_rows, experts
        return getattr(self.target, name)


class Recorder:
    """The target's dense FFN, as Transformer computes it, recording each row's top `k` neurons by |a|."""

    def __init__(self, i: int, gate_up, down, k: int, out: dict):
        self.i, self.gate_up, self.down, self.k, self.out = i, gate_up, down, k, out

    def __call__(self, h: torch.Tensor, x: torch.Tensor) -> None:
        a = kernels.swiglu(self.gate_up.matmul(h))
        top = a.abs().topk(self.k, dim=-1)  # sorted: a smaller k_in is a prefix
        self.out[self.i] = (top.indices.to(torch.int16), top.values.bfloat16())
        self.down.matmul(a, out=x)


class Oracle:
    """The caches of every layer (recency keys over the neurons) and the masks the draft's FFNs read."""

    def __init__(self, n_layers: int, ffn: int, capacity: int, k_in: int, pick=None):
        """`pick(i, h, a)`: each row's own neurons, int64 [T, k], intersected with the cache (None: the cache)."""
        self.L, self.F, self.C, self.k_in, self.pick = n_layers, ffn, capacity, k_in, pick
        self.mask: torch.Tensor | None = None  # [L, F] bool; None: every neuron
        self.sizes: list[int] = []

    def start(self, ids: torch.Tensor, vals: torch.Tensor) -> None:
        """A prompt's recorded activations: ids int16 [L, N, K], |a| [L, N, K] (K >= k_in, descending)."""
        self.ids, self.vals = ids[:, :, : self.k_in].long(), vals[:, :, : self.k_in].double()
        self.key = torch.full((self.L, self.F), -1.0, dtype=torch.float64)  # position + |a| / (1 + |a|)
        self.upto = 0

    def refresh(self, n: int) -> None:
        """Tokens [upto, n) have been run by the target: mark their neurons active, keep the C most recent."""
        for t in range(self.upto, n):
            v = self.vals[:, t]
            self.key.scatter_(1, self.ids[:, t], t + v / (1.0 + v))
        self.upto = n
        if self.C >= self.F:
            self.mask = None if self.pick is None else torch.ones(self.L, self.F, dtype=torch.bool)
            return
        top = self.key.topk(self.C, dim=1)
        self.mask = torch.zeros(self.L, self.F, dtype=torch.bool).scatter_(1, top.indices, top.values >= 0)
        self.sizes.append(int(self.mask.sum()) // self.L)

    def ffn(self, i: int, gate_up, down):
        def run(h: torch.Tensor, x: torch.Tensor) -> None:
            a = kernels.swiglu(gate_up.matmul(h))
            if h.shape[0] <= DENSE_ROWS and self.mask is not None:
                m = self.mask[i]
                if self.pick is not None:
                    m = torch.zeros(h.shape[0], self.F, dtype=torch.bool).scatter_(1, self.pick(i, h, a), True) & m
                a = a * m
            down.matmul(a, out=x)

        return run


def record(target, prompts, conts, k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per prompt, the target's top-k neurons (ids, |a|) per layer per token of prompt + continuation, from one
    dense forward whose logits must equal the target's own."""
    out: dict = {}
    rec = Transformer(
        target.args, Shared(target.weights, target.args.n_layers, lambda i, gu, dn: Recorder(i, gu, dn, k, out))
    )
    got = []
    for ids, cont in zip(prompts, conts):
        toks = torch.tensor(ids + cont)
        pos = torch.arange(len(toks))
        want = target.forward(toks, pos, target.new_cache(len(toks)))
        have = rec.forward(toks, pos, rec.new_cache(len(toks)))
        if not torch.equal(want, have):
            raise SystemExit(f"recording changed the target's logits (max diff {float((want - have).abs().max())})")
        got.append(tuple(torch.stack([out[i][j] for i in range(target.args.n_layers)]) for j in (0, 1)))
    return got


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.flash_oracle", description=__doc__.splitlines()[0])
    ap.add_argument("--capacities", default="1792,2688,4480", help="neurons a layer's cache holds")
    ap.add_argument("--k-in", default="0.3", help="shares of ffn_dim a processed token marks active (list)")
    ap.add_argument(
        "--variants",
        default="dense,A",
        help="dense, A (S = cache), B (cache & predictor top-k), T (cache & the row's true top-k)",
    )
    ap.add_argument("--predictor", default="int2")
    ap.add_argument("--widths", default="16")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--limit", type=int, default=0)
    ap.add_argument("--baseline", default="int4:32768", help="FORMAT:HEAD_ROWS of the 0.5B draft ('' for none)")
    a = ap.parse_args(argv)
    t_start = time.perf_counter()
    items = [p for f in PROMPTS for p in load_prompts(f)][: a.limit or None]
    r = read_inputs(RunConfig.from_options(mode="target", max_new_tokens=a.tokens), ThisMachine(), items)
    prompts = [r.prompt_ids(p)[0] for p in items]
    loaded = loading.load_store(r.target)
    target, F, L = loaded.model, r.target.args.ffn_dim, r.target.args.n_layers
    conts = [continuation(target, ids, a.tokens, set(r.tokenizer.stop_ids)) for ids in prompts]
    shares = [float(s) for s in a.k_in.split(",")]
    acts = record(target, prompts, conts, max(round(s * F) for s in shares))
    mib = lambda c: c * L * records.record_bytes(r.target.args.dim) / 2**20
    widths = [int(w) for w in a.widths.split(",")]
    print(f"{len(prompts)} prompts x {a.tokens} tokens of the target's greedy continuation (teacher-forced)")
    print(
        "| draft | capacity | k_in | MiB of caches | width | accepted / verification | draft forwards / verification "
        "| mean cache size | s |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")

    def row(label, cap, k_in, width, model, oracle=None):
        t0 = time.perf_counter()
        started = [-1]  # the prompt whose activations the oracle holds

        def refresh(n, m):
            if n != started[0]:
                oracle.start(*acts[n])
                started[0] = n
            oracle.refresh(m)

        hook = refresh if oracle is not None else None
        acc, fw = accepted(model, prompts, conts, TreeConfig(width=width, growth="best"), hook)
        size = f"{sum(oracle.sizes) / len(oracle.sizes):.0f}" if oracle is not None and oracle.sizes else "-"
        mb = f"{mib(cap):.1f}" if isinstance(cap, int) else "-"
        print(
            f"| {label} | {cap} | {k_in} | {mb} | {width} | {acc:.2f} | {fw:.1f} | {size} | "
            f"{time.perf_counter() - t0:.0f} |",
            flush=True,
        )

    kp = round(0.3 * F)
    pred = Predictor.load(r.target, a.predictor, dtype=torch.bfloat16) if "B" in a.variants.split(",") else None
    picks = {"B": lambda i, h, act: pred.top(i, h, kp), "T": lambda i, h, act: act.abs().topk(kp, dim=-1).indices}
    label = {"dense": "1.5B dense (self)", "A": "1.5B oracle A", "B": f"1.5B oracle B ({a.predictor})"}
    label["T"] = "1.5B oracle T (true top-k)"
    for variant in a.variants.split(","):
        caps = [F] if variant == "dense" else [int(c) for c in a.capacities.split(",")]
        for share in [1.0] if variant == "dense" else shares:
            for cap in caps:
                k_in = round(share * F)
                oracle = Oracle(L, F, cap, k_in, picks.get(variant))
                draft = Transformer(target.args, Shared(target.weights, L, oracle.ffn))
                for width in widths:
                    oracle.sizes = []
                    row(label[variant], cap, "-" if variant == "dense" else k_in, width, draft, oracle)
    if a.baseline:
        fmt, rows = a.baseline.split(":")
        small = loading.load_store(ensure_store("qwen2.5-coder-0.5b", fmt), head_rows=int(rows), tokenizer=False)
        for width in widths:
            row(f"0.5B {fmt}, head {rows}", "-", "-", width, small.model)
    print(f"total {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
