"""SmolLM3: Llama's block with layers that take no rotary embeddings (NoPE: every fourth by default, or the
config's `no_rope_layers`, 1 where a layer rotates), tied embeddings. llama.cpp hard-codes one NoPE layer in four
(`n_no_rope_layer_step`): a GGUF says nothing of which, so only that pattern reads from one."""

from __future__ import annotations

from models.families.base import Family, layer_kinds, windowed


def _hf(cfg: dict, a: dict) -> dict:
    n = a["n_layers"]
    interval = int(cfg.get("no_rope_layer_interval") or 4)
    rotates = cfg.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n)]
    if len(rotates) != n:
        raise ValueError(f"no_rope_layers has {len(rotates)} entries for {n} layers")
    nope = tuple(i for i, r in enumerate(rotates) if not r)
    # transformers puts a window (use_sliding_window) on the NoPE layers, as layer_types says
    sliding = layer_kinds(cfg, n, lambda i: bool(cfg.get("use_sliding_window")) and i in nope)
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    return {"nope_layers": nope, **windowed(window, sliding, a["context_length"])}


SMOLLM3 = Family(
    "smollm3",
    hf_types=("smollm3",),
    gguf_archs=("smollm3",),
    hf_defaults={"rope_theta": 2_000_000.0, "no_rope_layer_interval": 4},
    hf_keys=frozenset({"no_rope_layers", "no_rope_layer_interval"}),
    hf_fields=_hf,
    gguf_fields=lambda key, a: {"nope_layers": tuple(i for i in range(a["n_layers"]) if (i + 1) % 4 == 0)},
    gguf_permuted=True,
)
