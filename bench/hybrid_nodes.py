"""What a token tree costs a hybrid (issue 54): one verification forward over a tree of W nodes against one decode
step, resident, int4, on this machine's CPU kernels, for a Qwen 3.5-shaped model (gated delta-nets around one
attention layer in four) and the same shapes with attention in every layer.

    python -m bench.hybrid_nodes [--widths 1,2,4,8,16,32] [--layers 24] [--dim 1024]

The models are random (built by transformers: shapes matter here, not tokens), written once under
$CADENCE_HOME/bench/hybrid-*. A tree is a chain of its first half and a fan of the rest (a node's state is its
parent's stepped once, whatever the shape). Each figure is the median of five forwards; "per node" is what a node
past the first adds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from common.paths import home
from models.attention import Visibility
from formats.convert import convert
from formats.source_hf import HFSource
from formats.store import WeightStore


def _shapes(layers: int, dim: int, hybrid: bool) -> dict:
    types = ["linear_attention" if hybrid and (i + 1) % 4 else "full_attention" for i in range(layers)]
    return dict(
        hidden_size=dim,
        intermediate_size=3 * dim + dim // 2,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        layer_types=types,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
    )


def _store(layers: int, dim: int, hybrid: bool) -> WeightStore:
    root = home() / "bench" / f"hybrid-{'gdn' if hybrid else 'attn'}-{layers}x{dim}"
    if not (root / "int4" / "manifest.json").exists():
        from transformers import AutoConfig, AutoModelForCausalLM

        from bench.synth_family import tokenizer_files

        (root / "hf").mkdir(parents=True, exist_ok=True)
        vocab = tokenizer_files(root / "hf")  # Qwen 2.5's tokenizer, from the pulled target's store
        cfg = AutoConfig.for_model("qwen3_5_text", **{**_shapes(layers, dim, hybrid), "vocab_size": vocab})
        cfg.architectures = ["Qwen3_5ForCausalLM"]
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(root / "hf")
        convert(HFSource(root / "hf"), root / "int4", "int4")
    return WeightStore(root / "int4")


def _forward_s(model, prompt: torch.Tensor, width: int) -> float:
    """The median of five forwards of a W-node tree (a chain of half, then a fan) after `prompt`, its rows dropped."""
    cache = model.new_cache(len(prompt) + 64)
    model.forward(prompt, torch.arange(len(prompt)), cache)
    cache.commit()
    L, half = cache.length, max(1, width // 2)
    parents = [i - 1 for i in range(half)] + [half - 1] * (width - half)
    depth = [i + 1 for i in range(half)] + [half + 1] * (width - half)
    tokens = torch.randint(3, 30000, (width,))
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        model.forward(tokens, torch.tensor([L - 1 + d for d in depth]), cache, Visibility.tree(L, parents))
        times.append(time.perf_counter() - t0)
        cache.commit([])
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.hybrid_nodes", description=__doc__.split("\n\n")[0])
    p.add_argument("--widths", default="1,2,4,8,16,32")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--dim", type=int, default=1024)
    a = p.parse_args(argv)
    from formats import loading

    widths = [int(w) for w in a.widths.split(",")]
    torch.manual_seed(1)
    prompt = torch.randint(3, 30000, (64,))
    rows = {}
    for hybrid in (True, False):
        model = loading.load_store(_store(a.layers, a.dim, hybrid)).model
        _forward_s(model, prompt, 1)  # warm-up
        rows[hybrid] = [_forward_s(model, prompt, w) for w in widths]
    print(f"{'nodes':>5} | {'hybrid ms':>9} | {'attention ms':>12} | hybrid/attention")
    for i, w in enumerate(widths):
        h, t = rows[True][i] * 1e3, rows[False][i] * 1e3
        print(f"{w:>5} | {h:9.1f} | {t:12.1f} | {h / t:.2f}")
    for hybrid, name in ((True, "hybrid"), (False, "attention")):
        r, w = rows[hybrid], widths
        per = (r[-1] - r[0]) / (w[-1] - w[0]) * 1e3 if len(w) > 1 else 0.0
        print(
            f"{name}: one step {r[0] * 1e3:.1f} ms, a tree of {w[-1]} {r[-1] * 1e3:.1f} ms, {per:.2f} ms a node past the first"
        )


if __name__ == "__main__":
    main()
