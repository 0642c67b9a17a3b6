"""`--mode flash`: LLM in a flash (flash), APPROXIMATE, in this process.

The target's attention, norms and head stay resident; each layer's FFN computes only the neurons the
trained predictor picks (`--ffn-density` of them), from a neuron cache per layer that loads the bundles it
lacks from disk. Under `--memory-budget` the caches get what the budget leaves after everything else this
process holds (measured, not guessed): the window of recent tokens' neurons is as long as that memory.
Every output of the mode is marked approximate (`FlashSession.approximate`, the rows' `approximate`).
"""

from __future__ import annotations

from dataclasses import dataclass

from common.errors import CadenceError
from common.units import fmt as fmt_bytes
from engine.memory import kv_rows
from engine.plan import RunPlan
from flash.footprint import CACHE_TOKENS, predictor_bytes, predictors, top_k

MARGIN = 96 << 20  # activations, read buffers, allocator slack (85 MiB measured in a cgroup)


@dataclass(frozen=True)
class FlashPlan:
    budget: int  # 0: no budget (every neuron may stay)
    held: int  # this process once the model is in, its caches aside: interpreter, torch, tokenizer, weights
    predictor: str
    predictor_bytes: int  # of `held`
    kv: int
    capacity: int  # neurons per layer's cache
    cache_bytes: int

    def lines(self) -> list[str]:
        rows = [
            ("process with attention, head (measured)", self.held - self.predictor_bytes),
            (f"the {self.predictor} predictor", self.predictor_bytes),
            ("KV cache, activations", self.kv + MARGIN),
            (f"neuron caches ({self.capacity} a layer)", self.cache_bytes),
        ]
        total = [f"  {'total':<40}{fmt_bytes(self.total):>10} of {fmt_bytes(self.budget)}"] if self.budget else []
        return [f"  {label:<40}{fmt_bytes(n):>10}" for label, n in rows] + total

    @property
    def total(self) -> int:
        return self.held + self.kv + MARGIN + self.cache_bytes


def plan(run: RunPlan, process: int) -> FlashPlan:
    """The best predictor (flash/footprint.py `predictors`) that leaves caches of at least a token's
    neurons, and the caches' share of the budget: what is left once this process holds everything else (its
    bytes now, `process`, measured, and the predictor's), the KV cache and a pass's activations. `auto`: caches
    that hold CACHE_TOKENS tokens' neurons beside the best predictor. Where none fits, the sentence of the
    smallest."""
    names, refused = predictors(run.target), {}
    for name in names:
        try:
            return _plan(run, process, name)
        except CadenceError as e:
            refused[name] = e
    raise refused[min(names, key=lambda n: predictor_bytes(run.target, n))]  # the least it would take


def _plan(run: RunPlan, process: int, predictor: str) -> FlashPlan:
    from models import flash_records as records

    a, density = run.target.args, run.ffn_density
    per_neuron = a.n_layers * records.record_bytes(a.dim)
    k = top_k(density, a.ffn_dim)
    kv = a.kv_bytes(kv_rows(run), run.kv_dtype)
    pb = predictor_bytes(run.target, predictor)
    held = process + pb
    fixed = held + kv + MARGIN
    if not (run.budget or run.budget_auto):
        return FlashPlan(0, held, predictor, pb, kv, a.ffn_dim, a.ffn_dim * per_neuron)
    budget = fixed + CACHE_TOKENS * k * per_neuron if run.budget_auto else run.budget
    capacity = min(a.ffn_dim, max(0, budget - fixed) // per_neuron)
    if capacity < k and density < 1.0:
        raise CadenceError(
            f"--memory-budget {fmt_bytes(budget)} leaves room for {capacity} FFN neurons a layer beside the {predictor} "
            f"predictor and --ffn-density {density} needs {k}; give at least {fmt_bytes(fixed + k * per_neuron)} "
            "or a lower --ffn-density"
        )
    return FlashPlan(budget, held, predictor, pb, kv, capacity, capacity * per_neuron)


def _process_bytes() -> int:
    """This process's memory now (resident anonymous and file pages: what a memory cgroup charges it)."""
    import psutil

    return psutil.Process().memory_info().rss


class FlashSession:
    """The run's target as FlashWeights in this process, under the same speculation cycle (target-only)."""

    streamer = experts = None
    sched = None

    def __init__(self, run: RunPlan):
        import torch

        from flash.predictor import Predictor
        from flash.weights import FlashWeights
        from models.transformer import Transformer

        if run.device != "cpu":
            raise CadenceError("--mode flash runs on cadence's CPU kernels; use --device cpu")
        torch.set_num_threads(run.threads)
        store = run.target
        predictors(store)  # one sentence before the weights are read where there is none
        self.weights = FlashWeights(store, None, run.ffn_density)
        self.plan = plan(run, _process_bytes())  # measured with everything in but the predictor and the caches
        self.weights.predictor = Predictor.load(store, self.plan.predictor, dtype=torch.bfloat16)
        self.weights.allocate(self.plan.capacity)
        model = Transformer(store.args, self.weights)
        model.kv_dtype = run.kv_dtype
        self.loop = run.local_cycle(model, None)

    def start_generation(self) -> None:
        self.weights.reset_stats()

    def lines(self) -> list[str]:
        return [
            f"APPROXIMATE: LLM in a flash at FFN density {self.weights.density}, not the target's exact output",
            *self.plan.lines(),
        ]

    def fields(self, tokens: int) -> dict:
        """The row's flash fields: approximate, the density and what was read per token."""
        st = self.weights.stats
        return {
            "approximate": True,
            "ffn_density": self.weights.density,
            "flash": {
                **st.as_dict(),
                "predictor": self.plan.predictor,
                "cache_neurons_per_layer": self.plan.capacity,
                # the prompt's pass reads the dense FFNs once; each later token reads bundles
                "decode_read_bytes_per_token": st.bundles.bytes // max(1, tokens - 1),
            },
        }

    def close(self) -> None:
        self.weights.close()
