"""The families whose caches stream differently over the actors, their layers streamed through the loader under a
budget, int4: `tree` gives the target's own tokens (a draft that is the target itself, and the trie alone), as
`target` does. Which: a plain block, sliding windows (their ring of rows; one with its own rope base), and every kind
of recurrent layer (their states and rows). The other families' layers differ only in the math of a layer, which
streaming does not touch: tests/models/test_families.py checks that against transformers, and
tests/speculative/test_batch_verify.py their trees in batches, for all of FAMILIES."""

import dataclasses

import pytest
import torch

from common.settings import SamplingConfig, TreeConfig
from formats import loading
from formats.convert import convert
from formats.source_hf import HFSource
from formats.store import WeightStore
from scheduler.generation.memplan import Overheads, plan_memory, smallest_budget
from speculative.generate import generate_target
from tests.models.families import tiny_hf
from tests.scheduler.test_speculation_tiny import _run

N = 40
# one variant a family, the one with the most of what sets the family apart
FAMILIES = [
    ("llama", "llama3"),
    ("mistral", "sliding"),
    ("gemma2", "softcap"),
    ("gemma3_text", "linear"),
    ("phi3", "partial_longrope"),
    ("granite", "plain"),
    ("olmo2", "plain"),
    ("qwen2", "sliding"),
    ("exaone4", "plain"),  # NoPE global layers among sliding ones, post-norms, q/k norms per head
    ("glm4", "plain"),  # four norms, interleaved partial rotary, q/k/v biases
    ("ministral3", "plain"),  # queries scaled by position after YaRN
    ("lfm2", "plain"),  # short-convolution layers: each tree node's taps its own ancestors'
    ("falcon_h1", "normed"),  # Mamba-2 beside attention in each layer: each node's state its parent's stepped
    ("nemotron_h", "plain"),  # a layer a part: Mamba-2, relu^2 MLP, NoPE attention
    ("olmo_hybrid", "plain"),  # pre-norm delta-nets (beta up to 2) beside post-norm attention
    ("qwen3_5_text", "plain"),  # gated delta-nets: each node's state its parent's stepped; gated attention
    ("gemma4_text", "ple"),  # full heads of their own size, keys shared between layers, per-layer embeddings
]


STREAMED = [
    (mt, v)
    for mt, v in FAMILIES
    if mt
    in (
        "llama",
        "mistral",
        "gemma3_text",
        "lfm2",
        "falcon_h1",
        "nemotron_h",
        "olmo_hybrid",
        "qwen3_5_text",
        "gemma4_text",
    )
]


@pytest.mark.parametrize("mt,v", STREAMED)
def test_tree_is_the_target_with_streamed_layers_over_the_actors(tmp_path, mt, v):
    store = WeightStore(convert(HFSource(tiny_hf(mt, v, tmp_path / "hf", seed=1)), tmp_path / "int4", "int4"))
    g = torch.Generator().manual_seed(3)
    base = torch.randint(3, 300, (14,), generator=g).tolist()
    prompt = base + base[:7]  # past every window of 8, and a repeat for the trie
    reference = generate_target(loading.load_store(store), prompt, N, SamplingConfig(), stop_at_eos=False).new_ids
    groups = {n: store.groups[n].nbytes for n in store.group_names() if n != "embed"}
    o = Overheads(**{f.name: 0 for f in dataclasses.fields(Overheads)})
    plan = plan_memory(smallest_budget(groups, 0, 0, 0, overheads=o) + 4096, groups, 0, 0, 0, overheads=o)
    assert plan.streamed  # layers come from disk every forward
    stores = {"target": store}
    for draft in ("target", None):
        s, spec = _run(stores, draft, plan=plan)
        try:
            for mode in ("target", "tree"):
                cfg = TreeConfig(mode="tree", ahead=2)
                got = spec.loop.generate(prompt, N, set(), mode=mode, cfg=cfg)
                assert got.new_ids == reference, (draft, mode)
            assert got.stats["loads"] >= len(plan.streamed), got.stats
            assert got.stats["verifications"] > 0 or draft is None, got.stats  # the trie may find nothing to try
        finally:
            spec.close()
            s.shutdown()
