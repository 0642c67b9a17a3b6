"""`--mode flash`: LLM in a flash (models/flash), APPROXIMATE, in this process.

The target's attention, norms and head stay resident; each layer's FFN computes only the neurons the
trained predictor picks (`--ffn-density` of them), from a neuron cache per layer that loads the bundles it
lacks from disk. Under `--memory-budget` the caches get what the budget leaves after everything else this
process holds (measured, not guessed): the window of recent tokens' neurons is as long as that memory.
Every output of the mode is marked approximate (`FlashSession.approximate`, the rows' `approximate`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from common.errors import CadenceError
from common.units import fmt as fmt_bytes, parse_bytes
from engine.memory import kv_rows
from engine.resolve import Resolved

MARGIN = 64 << 20  # activations of a pass, the allocator's slack, the reads' buffers
CACHE_TOKENS = 2  # `auto`: caches that hold two tokens' neurons a layer


@dataclass(frozen=True)
class FlashPlan:
    budget: int  # 0: no budget (every neuron may stay)
    process: int  # this process before the model: interpreter, torch, kernels, tokenizer
    resident: int  # attention, norms, head, the dense scratch, the predictor
    kv: int
    capacity: int  # neurons per layer's cache
    cache_bytes: int

    def lines(self) -> list[str]:
        return [
            f"  process (interpreter, torch, tokenizer) {fmt_bytes(self.process):>10}",
            f"  attention, head, predictor, scratch     {fmt_bytes(self.resident):>10}",
            f"  KV cache                                {fmt_bytes(self.kv):>10}",
            f"  neuron caches ({self.capacity} a layer)         {fmt_bytes(self.cache_bytes):>10}",
        ]


def resident_bytes(store, predictor) -> int:
    """What FlashWeights keeps besides the caches: every layer's attention and norms, the head, one layer's
    dense FFN (the scratch a prompt's pass reads into) and the predictor."""
    from models.flash.weights import ATTENTION, FFN

    a = store.args
    n = predictor.nbytes
    span = 0
    for i in range(a.n_layers):
        for t in ATTENTION:
            entry = store.tensors.get(f"blk.{i}.{t}")
            n += sum(x["nbytes"] for x in entry["arrays"].values()) if entry else 0
        span = max(span, sum(x["nbytes"] for t in FFN for x in store.tensors[f"blk.{i}.{t}"]["arrays"].values()))
    return n + span + sum(store.groups[g].nbytes for g in store.head_groups())


def plan(r: Resolved, predictor, process: int) -> FlashPlan:
    from models.flash import records

    cfg, store = r.cfg, r.target
    a = store.args
    record = records.record_bytes(a.dim)
    k = max(1, round(cfg.ffn_density * a.ffn_dim))
    resident = resident_bytes(store, predictor)
    kv = a.kv_bytes_per_token() * kv_rows(cfg)
    fixed = process + resident + kv + MARGIN
    if not cfg.memory_budget:
        return FlashPlan(0, process, resident, kv, a.ffn_dim, a.ffn_dim * a.n_layers * record)
    need = fixed + CACHE_TOKENS * k * a.n_layers * record if cfg.memory_budget == "auto" else None
    budget = need if need is not None else parse_bytes(cfg.memory_budget)
    capacity = min(a.ffn_dim, max(0, budget - fixed) // (a.n_layers * record))
    if capacity < k:
        smallest = fixed + k * a.n_layers * record
        raise CadenceError(
            f"--memory-budget {fmt_bytes(budget)} leaves room for {capacity} FFN neurons a layer and --ffn-density "
            f"{cfg.ffn_density} needs {k}; give at least {fmt_bytes(smallest)} or a lower --ffn-density"
        )
    return FlashPlan(budget, process, resident, kv, capacity, capacity * a.n_layers * record)


def _process_bytes() -> int:
    """This process's memory now (resident anonymous and file pages: what a memory cgroup charges it)."""
    import psutil

    return psutil.Process().memory_info().rss


class FlashSession:
    """The run's target as FlashWeights in this process, under the same speculation cycle (target-only)."""

    streamer = experts = None
    sched = None
    approximate = True

    def __init__(self, r: Resolved):
        import torch

        from models.flash.predictor import Predictor
        from models.flash.weights import FlashWeights
        from models.transformer import Transformer
        from speculative.loop import Speculation
        from speculative.verify import LocalTarget

        cfg = r.cfg
        if cfg.device != "cpu":
            raise CadenceError("--mode flash runs on cadence's CPU kernels; use --device cpu")
        torch.set_num_threads(cfg.threads or os.cpu_count() or 1)
        store = r.target
        predictor = Predictor.load(store)
        self.plan = plan(r, predictor, _process_bytes())
        self.weights = FlashWeights(store, predictor, cfg.ffn_density, self.plan.capacity)
        self.loop = Speculation(
            LocalTarget(Transformer(store.args, self.weights)),
            None,
            "flash",
            cfg.tree,
            cfg.sampling,
            cfg.context,
            store.args.context_length,
        )

    def fields(self, tokens: int) -> dict:
        """The row's flash fields: approximate, the density and what was read per token."""
        st = self.weights.stats
        return {
            "approximate": True,
            "ffn_density": self.weights.density,
            "flash": {
                **st.as_dict(),
                "cache_neurons_per_layer": self.plan.capacity,
                # the prompt's pass reads the dense FFNs once; each later token reads bundles
                "decode_read_bytes_per_token": st.bundle_bytes // max(1, tokens - 1),
            },
        }

    def close(self) -> None:
        self.weights.close()
