"""Sampled speculation on tiny random models: the emitted tokens follow the target's distribution.

One speculation cycle (draft a tree, verify it) is repeated from the same state with fresh random
draws; the first two tokens it emits are compared by a chi-square test with the target's exact
joint distribution p(x1) p(x2 | x1), computed by running the target on every x1.
"""

import pytest
import torch

from models.args import ModelArgs
from models.sampling import Sampler, probs
from common.settings import SamplingConfig
from models.transformer import Transformer
from models.weights import TensorWeights, random_tensors
from speculative.drafter import Drafter
from common.settings import TreeConfig
from speculative.verify import Verifier

ARGS = ModelArgs(
    arch="qwen2",
    vocab_size=32,
    dim=64,
    n_layers=1,
    n_heads=2,
    n_kv_heads=1,
    ffn_dim=64,
    norm_eps=1e-6,
    rope_base=10000.0,
    context_length=64,
    qkv_bias=True,
    tied_embeddings=False,
)
SAMPLING = SamplingConfig(temperature=1.0, top_p=0.95)
PROMPT = [3, 17, 5, 9]
ROOT = 11


def _model(seed, scale, noise_seed=None):
    t = random_tensors(ARGS, seed, scale=scale)
    if noise_seed is not None:  # a draft that resembles the target, as a real draft does
        noise = random_tensors(ARGS, noise_seed, scale=scale)
        t = {k: v + 0.15 * noise[k] for k, v in t.items()}
    return Transformer(ARGS, TensorWeights(ARGS, t, "fp32"))


def _exact_joint(target):
    """p(x1, x2) after PROMPT + ROOT under the sampling config, by enumeration."""
    cache = target.new_cache(16)
    logits = target.forward(torch.tensor(PROMPT + [ROOT]), torch.arange(5), cache)[-1]
    cache.commit()
    p1 = probs(logits, SAMPLING)
    joint = torch.zeros(ARGS.vocab_size, ARGS.vocab_size)
    for x1 in range(ARGS.vocab_size):
        if p1[x1] == 0:
            continue
        l2 = target.forward(torch.tensor([x1]), torch.tensor([5]), cache)[0]
        cache.rewind(5)
        joint[x1] = p1[x1] * probs(l2, SAMPLING)
    return joint


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_speculative_sampling_matches_the_target_distribution(mode):
    target, draft = _model(1, 2.0), _model(1, 2.0, noise_seed=2)
    joint = _exact_joint(target)
    cfg = TreeConfig(mode=mode, width=4, chain_k=3, branch_threshold=0.15, alpha=0.0, trie=False, adaptive=False)
    verifier, drafter = Verifier(target, SAMPLING), Drafter(draft, SAMPLING, cfg)
    verifier.start(PROMPT, 16)
    drafter.start(PROMPT, 16)
    drafter.push([ROOT])
    drafter.build_tree()  # feeds the prompt and the root once; every trial starts from here
    L = drafter.cache.length
    n, counts = 7000, torch.zeros_like(joint)
    accepted = 0
    for i in range(n):
        verifier.cache.rewind(len(PROMPT))
        drafter.cache.rewind(L - 1)
        drafter.feed.pending = [ROOT]
        verifier.sampler = Sampler(SamplingConfig(SAMPLING.temperature, SAMPLING.top_p, 10_000 + i))
        drafter.pacer.sampler = Sampler(SamplingConfig(SAMPLING.temperature, SAMPLING.top_p, 20_000 + i))
        d = drafter.build_tree()
        v = verifier.verify_tree(d.tree, d.trials)
        emitted = d.tree.tokens_of(v.path) + [v.next_token]
        accepted += len(v.path)
        if len(emitted) < 2:  # the cycle emitted one token: draw the second from the target itself
            emitted.append(verifier.step(emitted[0]))
        counts[emitted[0], emitted[1]] += 1
    assert accepted > n // 3, "the draft should be accepted often enough for the test to mean something"
    expected, observed = joint.flatten() * n, counts.flatten()
    # the whole table (rare cells pooled) ...
    keep = expected >= 5
    _check(
        torch.cat([expected[keep], expected[~keep].sum().view(1)]),
        torch.cat([observed[keep], observed[~keep].sum().view(1)]),
    )
    # ... and the eight likeliest outcomes against the rest, which has the power to see a 2% deviation
    top = torch.topk(expected, 8).indices
    rest = torch.ones_like(expected, dtype=torch.bool)
    rest[top] = False
    e = torch.cat([expected[top], expected[rest].sum().view(1)])
    limit = _check(e, torch.cat([observed[top], observed[rest].sum().view(1)]))
    shift = 0.02 * n  # 2% of the mass moved between the two likeliest outcomes, where it is hardest to see
    assert shift**2 / e[0] + shift**2 / e[1] > limit


def _check(e: torch.Tensor, o: torch.Tensor) -> float:
    """Chi-square of observed o against expected e below its 99.9% quantile (Wilson-Hilferty); returns it."""
    dof = len(e) - 1
    limit = dof * (1 - 2 / (9 * dof) + 3.09 * (2 / (9 * dof)) ** 0.5) ** 3
    chi2 = float(((o - e) ** 2 / e).sum())
    assert chi2 < limit, (chi2, limit, dof)
    return limit


@pytest.mark.parametrize("greedy", [True, False])
def test_a_draft_with_a_cut_head_proposes_its_rows_and_samples_over_the_whole_vocabulary(tmp_path, greedy):
    """A draft keeping its head's first `cut` rows (FR-Spec) gives logits that wide: greedy trees stay inside
    them; sampled trials carry distributions over the whole vocabulary (the verifier's acceptance test reads
    them), with no mass past the cut."""
    from models.convert import convert
    from models.source_hf import HFSource
    from models.store import WeightStore
    from models.weights import StreamingWeights
    from tests.conftest import TINY
    from tests.models.tiny_files import write_hf_dir

    args, cut = TINY["qwen"], 120
    store = WeightStore(
        convert(HFSource(write_hf_dir(tmp_path / "hf", args, random_tensors(args, seed=4))), tmp_path / "s", "int4")
    )
    draft = Transformer(store.args, StreamingWeights(store, set(store.group_names()) - {"embed"}, head_rows=cut))
    sampling = SamplingConfig() if greedy else SamplingConfig(temperature=1.5, top_p=1.0)
    cfg = TreeConfig(mode="tree", width=6, branch_threshold=0.01, alpha=0.0, trie=False, adaptive=False)
    drafter = Drafter(draft, sampling, cfg)
    drafter.start([3, 17, 5, 9], 32)
    drafter.push([11])
    d = drafter.build_tree()
    assert len(d.tree) > 2 and all(n.token < cut for n in d.tree.nodes[1:])
    if greedy:
        assert draft.forward(torch.tensor([3, 5]), torch.arange(2), draft.new_cache(4)).shape == (2, cut)
    else:
        qs = [q for trials in d.trials.values() for _, q in trials]
        assert qs and all(q.shape == (args.vocab_size,) and q[cut:].sum() == 0 for q in qs)
