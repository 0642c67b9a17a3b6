"""Our transformer on tiny random models: trees, caches and blocks give exactly the sequential result."""

import dataclasses

import pytest
import torch

from common.errors import CadenceError
from models import kernels, layer_kernel
from models.attention import Visibility
from models.transformer import Transformer
from formats.weights import TensorWeights, random_tensors


def _model(args, fmt="fp32", seed=0):
    return Transformer(args, TensorWeights(args, random_tensors(args, seed), fmt))


def _sequential_logits(model, ids):
    cache = model.new_cache(len(ids) + 1)
    out = []
    for i, t in enumerate(ids):
        out.append(model.forward(torch.tensor([t]), torch.tensor([i]), cache)[0])
        cache.commit()
    return torch.stack(out)


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8", "int4"])
def test_causal_block_equals_token_by_token(tiny_args, fmt):
    model = _model(tiny_args, fmt)
    ids = torch.randint(0, tiny_args.vocab_size, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    cache = model.new_cache(64)
    block = model.forward(torch.tensor(ids), torch.arange(40), cache)
    assert torch.equal(block, _sequential_logits(model, ids))


def _random_tree(n, g):
    return [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]


@pytest.mark.parametrize("fmt", ["fp32", "int4"])
def test_tree_forward_equals_each_path_run_alone(tiny_args, fmt):
    g = torch.Generator().manual_seed(2)
    model = _model(tiny_args, fmt)
    prefix = torch.randint(0, tiny_args.vocab_size, (9,), generator=g).tolist()
    parents = _random_tree(15, g)
    tokens = torch.randint(0, tiny_args.vocab_size, (15,), generator=g).tolist()
    depth = [0] * 15
    for i, p in enumerate(parents):
        depth[i] = 0 if p < 0 else depth[p] + 1
    cache = model.new_cache(64)
    model.forward(torch.tensor(prefix), torch.arange(9), cache)
    cache.commit()
    vis = Visibility.tree(cache.length, parents)
    tree_logits = model.forward(torch.tensor(tokens), torch.tensor(depth) + 9, cache, vis)
    for node in range(15):
        path = []
        n = node
        while n >= 0:
            path.append(tokens[n])
            n = parents[n]
        seq = _sequential_logits(model, prefix + path[::-1])
        assert torch.equal(tree_logits[node], seq[-1]), f"node {node}"


def test_commit_keeps_the_accepted_path(tiny_args):
    g = torch.Generator().manual_seed(3)
    model = _model(tiny_args)
    prefix = torch.randint(0, tiny_args.vocab_size, (6,), generator=g).tolist()
    parents = [-1, 0, 0, 1, 2, 3]  # accept the path 0 -> 1 -> 3 -> 5
    tokens = torch.randint(0, tiny_args.vocab_size, (6,), generator=g).tolist()
    depth = [0, 1, 1, 2, 2, 3]
    cache = model.new_cache(32)
    model.forward(torch.tensor(prefix), torch.arange(6), cache)
    cache.commit()
    model.forward(torch.tensor(tokens), torch.tensor(depth) + 6, cache, Visibility.tree(6, parents))
    cache.commit([0, 1, 3, 5])
    assert cache.length == 10
    nxt = 11
    after = model.forward(torch.tensor([nxt]), torch.tensor([10]), cache)[0]
    seq = _sequential_logits(model, prefix + [tokens[0], tokens[1], tokens[3], tokens[5], nxt])
    assert torch.equal(after, seq[-1])


def test_rewind_then_redo_gives_the_same_logits(tiny_args):
    model = _model(tiny_args)
    cache = model.new_cache(32)
    model.forward(torch.arange(5), torch.arange(5), cache)
    cache.commit()
    a = model.forward(torch.tensor([7, 8]), torch.tensor([5, 6]), cache)
    cache.commit()
    cache.rewind(5)
    b = model.forward(torch.tensor([7, 8]), torch.tensor([5, 6]), cache)
    assert torch.equal(a, b)


def test_mask_visibility_is_the_general_form(tiny_args):
    model = _model(tiny_args)
    cache = model.new_cache(32)
    model.forward(torch.arange(4), torch.arange(4), cache)
    cache.commit()
    parents = [-1, 0, 0]
    tree = Visibility.tree(4, parents)
    a = model.forward(torch.tensor([1, 2, 3]), torch.tensor([4, 5, 5]), cache, tree)
    cache.rewind(4)
    b = model.forward(torch.tensor([1, 2, 3]), torch.tensor([4, 5, 5]), cache, Visibility.from_mask(tree.dense_mask(7)))
    assert torch.equal(a, b)


def test_bad_keep_and_full_cache_are_refused(tiny_args):
    model = _model(tiny_args)
    cache = model.new_cache(8)
    model.forward(torch.arange(3), torch.arange(3), cache)
    with pytest.raises(ValueError):
        cache.commit([2, 1])
    cache.commit()
    with pytest.raises(CadenceError, match="KV cache holds 8"):
        model.forward(torch.arange(6), torch.arange(3, 9), cache)
    with pytest.raises(CadenceError, match="context"):
        model.new_cache(tiny_args.context_length + 1)


@pytest.mark.parametrize("tempered", [False, True], ids=["plain", "tempered"])
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_layer_in_one_kernel_call_gives_the_separate_calls_bits(tiny_args, fmt, tempered):
    """csrc/layer.cpp runs each layer in one call and one parallel region; `block_fused`'s ~10 calls are the
    reference: the same logits bit for bit for a prompt, a token and a tree, on one thread and on two. Queries
    scaled by their positions (Ministral 3), their floor steps every 4 positions here, alike."""
    if not kernels.available():
        pytest.skip("no kernel library here (no C++ compiler)")
    if tempered:
        tiny_args = dataclasses.replace(tiny_args, attn_temp_beta=0.1, attn_temp_scale=4.0, attn_temp_offset=1)
    model = _model(tiny_args, fmt)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            _one_call_against_separate(model, 37, 11, 0, tiny_args.vocab_size, keys=True)
    finally:
        torch.set_num_threads(threads)


def _one_call_against_separate(model, n: int, width: int, lo: int, hi: int, keys: bool = False) -> None:
    """A prompt of n tokens, one more token and a random tree of `width` (token ids in [lo, hi)) through every layer in
    one kernel call and through the separate calls: the same logits bit for bit (and cache rows, with `keys`)."""
    a = model.args
    assert all(layer_kernel.record(model.weights.layer(i), a, i) is not None for i in range(a.n_layers))
    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(lo, hi, (n,), generator=g)
    parents = _random_tree(width, g)
    tree = torch.randint(lo, hi, (width,), generator=g)
    depth = [0] * width
    for i, p in enumerate(parents):
        depth[i] = 0 if p < 0 else depth[p] + 1

    def run(one_call: bool) -> list[torch.Tensor]:
        model.layer_calls = one_call
        cache = model.new_cache(n + width + 8)
        out = [model.forward(prefix, torch.arange(n), cache)]
        cache.commit()
        out.append(model.forward(torch.tensor([3]), torch.tensor([n]), cache))
        cache.commit()
        out.append(model.forward(tree, torch.tensor(depth) + n + 1, cache, Visibility.tree(n + 1, parents)))
        return out + ([cache.k[:, :, : n + 1 + width], cache.v[:, :, : n + 1 + width]] if keys else [])

    for x, y in zip(run(False), run(True)):
        assert torch.equal(x, y)


def test_a_batch_s_tempered_layers_in_one_call_give_each_generation_its_separate_calls_bits(tiny_args):
    """`cad_layer_many` scales each generation's queries by that generation's positions (Ministral 3): every
    generation's logits are those of its forward alone through the separate calls."""
    if not kernels.available():
        pytest.skip("no kernel library here (no C++ compiler)")
    from models.batch import Rows, forward_many_steps
    from models.requests import drive

    args = dataclasses.replace(tiny_args, attn_temp_beta=0.1, attn_temp_scale=3.0, attn_temp_offset=1)
    model = _model(args, "int4")
    assert layer_kernel.record(model.weights.layer(0), args, 0) is not None
    prompts = [torch.tensor([5, 77, 200, 12, 9]), torch.tensor([150, 151]), torch.tensor([2, 64, 33, 260, 101, 7, 8])]
    starts = [0, 9, 4]  # each generation at its own positions
    pos = [torch.arange(len(t)) + s for t, s in zip(prompts, starts)]
    got = drive(
        forward_many_steps(model, [Rows(t, p, model.new_cache(32)) for t, p in zip(prompts, pos)]), model.weights
    )
    model.layer_calls = False
    for g, t, p in zip(got, prompts, pos):
        assert torch.equal(g, model.forward(t, p, model.new_cache(32)))


def test_layers_the_one_call_cannot_take_go_through_the_separate_calls(tiny_args):
    """Dense weights (and q/k norms, experts, LLM in a flash) have no record: `block_fused` computes them."""
    model = _model(tiny_args, "fp32")
    assert layer_kernel.record(model.weights.layer(0), tiny_args, 0) is None
    ids = torch.arange(6)
    assert torch.equal(model.forward(ids, torch.arange(6), model.new_cache(8)), _sequential_logits(model, ids.tolist()))


ONE_CALL = [("gemma4_text", "plain"), ("ministral3", "plain"), ("gpt_oss", "plain"), ("glm4_moe", "air")]


@pytest.mark.parametrize("mt,variant", ONE_CALL + [("llama4_text", "plain")])
def test_a_family_s_layers_in_one_kernel_call_give_the_separate_calls_bits(tmp_path, mt, variant):
    """Gemma 4's layers (the values' weightless norm, the layer's output scalar, full-attention layers with wider heads
    and fewer KV heads of their own, proportional rope), Ministral 3's (queries scaled by position), and the attention
    of the layers of experts of gpt-oss (sinks, the output's bias, sliding windows), GLM-4.5 (partial rope) and
    Llama 4 (L2 norms, chunks, NoPE layers with tempered queries) in the one-call layer kernel: the separate calls'
    logits bit for bit, for a prompt, a token and a tree."""
    if not kernels.available():
        pytest.skip("no kernel library here (no C++ compiler)")
    from formats import loading
    from formats.convert import convert
    from formats.source_hf import HFSource
    from tests.models.families import tiny_hf

    store = convert(HFSource(tiny_hf(mt, variant, tmp_path / "hf")), tmp_path / "int4", "int4")
    _one_call_against_separate(loading.load_store(store).model, 21, 9, 3, 250)


def test_falcon_h1_s_layers_keep_their_mamba_mixer_beside_the_one_call_attention(tmp_path):
    """Falcon-H1's layers attend and run Mamba-2 side by side: the one-call kernel (attention and FFN only) must not
    take them, or the mixer is skipped. The logits with the one-call kernel allowed equal those without it."""
    if not kernels.available():
        pytest.skip("no kernel library here (no C++ compiler)")
    from formats import loading
    from formats.convert import convert
    from formats.source_hf import HFSource
    from tests.models.families import tiny_hf

    model = loading.load_store(
        convert(HFSource(tiny_hf("falcon_h1", "plain", tmp_path / "hf")), tmp_path / "q", "int4")
    ).model
    ids = torch.randint(3, 250, (12,), generator=torch.Generator().manual_seed(1))
    out = []
    for one_call in (False, True):
        model.layer_calls = one_call
        out.append(model.forward(ids, torch.arange(12), model.new_cache(16)))
    assert torch.equal(out[0], out[1])
