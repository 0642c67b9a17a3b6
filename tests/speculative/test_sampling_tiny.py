"""Sampling controls on tiny random models (models/sampling.py): each control draws from the distribution it
defines (a chi-square over seeds against a plain reference written here), and speculation under it is the target
alone token for token with the same seed: tree, chain and a batch, greedy with penalties too. The tokens two
speculative cycles emit follow the target's exact joint distribution."""

from dataclasses import replace

import pytest
import torch

from common.settings import SamplingConfig, TreeConfig
from models.args import ModelArgs
from models.sampling import choose, noise
from models.transformer import Transformer
from formats.weights import TensorWeights, random_tensors
from speculative.batch import Lockstep, run_all
from speculative.drafter import Drafter, LocalDraft
from speculative.loop import Speculation
from speculative.slots import LocalBatch
from speculative.verify import LocalTarget

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
    context_length=96,
    qkv_bias=True,
    tied_embeddings=False,
)
PROMPT = [3, 17, 5, 9, 17, 3, 3]
CONTROLS = {
    "temperature": SamplingConfig(temperature=1.0),
    "top_k": SamplingConfig(temperature=0.7, top_k=5),
    "top_p": SamplingConfig(temperature=1.2, top_p=0.8),
    "min_p": SamplingConfig(temperature=1.0, min_p=0.1),
    "penalties": SamplingConfig(
        temperature=1.0, presence_penalty=0.8, frequency_penalty=0.5, repetition_penalty=1.3, repeat_last_n=6
    ),
    "all": SamplingConfig(temperature=0.9, top_k=12, top_p=0.9, min_p=0.02, frequency_penalty=0.3),
}


def reference(logits: torch.Tensor, cfg: SamplingConfig, text: list[int]) -> torch.Tensor:
    """The distribution a control defines, written plainly: penalties over the window, softmax(x / T), then top_k,
    the top_p nucleus and min_p, each renormalised."""
    x = logits.double().clone()
    n = cfg.repeat_last_n
    window = text if n < 0 else text[len(text) - min(n, len(text)) :] if n else []
    for tok in set(window):
        v = float(x[tok])
        v = v / cfg.repetition_penalty if v > 0 else v * cfg.repetition_penalty
        x[tok] = v - window.count(tok) * cfg.frequency_penalty - cfg.presence_penalty
    p = torch.softmax(x / cfg.temperature, -1)
    if cfg.top_k:
        kth = p.sort(descending=True).values[cfg.top_k - 1]
        p = torch.where(p >= kth, p, 0.0)
        p = p / p.sum()
    if cfg.top_p < 1:
        sp = p.sort(descending=True).values
        edge = sp[int(((sp.cumsum(0) - sp) < cfg.top_p).sum()) - 1]
        p = torch.where(p >= edge, p, 0.0)
    if cfg.min_p:
        p = torch.where(p >= cfg.min_p * p.max(), p, 0.0)
    return p / p.sum()


def _model(seed, scale, noise_seed=None):
    t = random_tensors(ARGS, seed, scale=scale)
    if noise_seed is not None:  # a draft that resembles the target, as a real draft does
        extra = random_tensors(ARGS, noise_seed, scale=scale)
        t = {k: v + 0.15 * extra[k] for k, v in t.items()}
    return Transformer(ARGS, TensorWeights(ARGS, t, "fp32"))


@pytest.fixture(scope="module")
def pair():
    return _model(1, 2.0), _model(1, 2.0, noise_seed=2)


def _check(e: torch.Tensor, o: torch.Tensor) -> float:
    """Chi-square of observed o against expected e below its 99.9% quantile (Wilson-Hilferty), rare cells pooled;
    returns the limit."""
    keep = e >= 5
    e = torch.cat([e[keep], e[~keep].sum().view(1)])
    o = torch.cat([o[keep], o[~keep].sum().view(1)])
    if e[-1] == 0:
        e, o = e[:-1], o[:-1]
    dof = len(e) - 1
    limit = dof * (1 - 2 / (9 * dof) + 3.09 * (2 / (9 * dof)) ** 0.5) ** 3
    chi2 = float(((o - e) ** 2 / e).sum())
    assert chi2 < limit, (chi2, limit, dof)
    return limit


@pytest.mark.parametrize("name", sorted(CONTROLS))
def test_each_control_draws_from_the_distribution_it_defines(name):
    cfg = CONTROLS[name]
    logits = torch.randn(ARGS.vocab_size, generator=torch.Generator().manual_seed(5)) * 2.5
    text = PROMPT + [11, 11, 4]
    p = reference(logits, cfg, text)
    n, counts = 4000, torch.zeros(ARGS.vocab_size, dtype=torch.float64)
    for seed in range(n):
        counts[choose(logits, replace(cfg, seed=seed), text)] += 1
    assert counts[p == 0].sum() == 0, "a token the control leaves out was drawn"
    _check(p * n, counts)


def test_a_positions_draw_depends_on_the_seed_and_the_position_alone():
    a, b = noise(7, 100, 10_000), noise(7, 100, 5_000)
    assert torch.equal(a[:5_000], b) and not torch.equal(noise(7, 101, 50), a[:50])
    assert not torch.equal(noise(8, 100, 50), a[:50])


def _generate(pair, mode, cfg, n=24, draft=None):
    target, d = pair
    tree = TreeConfig(mode="chain" if mode == "chain" else "tree", width=6, chain_k=3, trie=False, adaptive=False)
    loop = Speculation(LocalTarget(target), LocalDraft(draft or d), mode, tree, cfg, 96)
    return loop.generate(PROMPT, n, set()).new_ids


@pytest.mark.parametrize("name", ["greedy+penalties", *sorted(CONTROLS)])
def test_tree_and_chain_are_the_target_alone_under_every_control(pair, name):
    """Token for token, for several seeds: a tree node is accepted where its token is the target's own choice after
    its parent's row, with that row's own text and position."""
    base = CONTROLS.get(name) or SamplingConfig(repetition_penalty=1.5, presence_penalty=0.5, repeat_last_n=-1)
    for seed in range(3):
        cfg = replace(base, seed=seed)
        alone = _generate(pair, "target", cfg)
        assert _generate(pair, "tree", cfg) == alone, seed
        assert _generate(pair, "chain", cfg) == alone, seed
    if name == "greedy+penalties":  # the penalties change the text: a test of them, not of nothing
        assert alone != _generate(pair, "target", SamplingConfig())


def test_a_seeded_generation_is_the_same_alone_and_beside_others(pair):
    target, draft = pair
    tree = TreeConfig(mode="tree", width=6, trie=False)
    loop = Speculation(LocalTarget(target), LocalDraft(draft), "tree", tree, SamplingConfig(), 96)
    settings = [SamplingConfig(temperature=0.9, seed=s, top_k=8, frequency_penalty=0.4) for s in (11, 12, 13)]
    prompts = [PROMPT, PROMPT[:4], PROMPT + [1, 2]]
    alone = [loop.generate(p, 20, set(), mode="target", sampling=c).new_ids for p, c in zip(prompts, settings)]
    batch = Lockstep(loop, LocalBatch(target), lambda slot: LocalDraft(draft), 3, LocalDraft.propose_many)
    for i, (p, c) in enumerate(zip(prompts, settings)):
        batch.join(i, p, 20, set(), sampling=c)
    got = {k: o.result.new_ids for k, o in run_all(batch, iter(())) if o.result is not None}
    assert got == dict(enumerate(alone))
    assert len({tuple(a) for a in alone}) == 3


def test_speculative_sampling_matches_the_target_joint_distribution(pair):
    """The first two tokens a tree emits over many seeds against the exact p(x1) p(x2 | x1), by enumeration."""
    target, _ = pair
    cfg = CONTROLS["all"]
    cache = target.new_cache(16)
    logits = target.forward(torch.tensor(PROMPT), torch.arange(len(PROMPT)), cache)[-1]
    cache.commit()
    p1 = reference(logits, cfg, PROMPT)
    joint = torch.zeros(ARGS.vocab_size, ARGS.vocab_size, dtype=torch.float64)
    for x1 in torch.nonzero(p1).flatten().tolist():
        l2 = target.forward(torch.tensor([x1]), torch.tensor([len(PROMPT)]), cache)[0]
        cache.rewind(len(PROMPT))
        joint[x1] = p1[x1] * reference(l2, cfg, PROMPT + [x1])
    n, counts = 1500, torch.zeros_like(joint)
    for seed in range(n):
        x1, x2 = _generate(pair, "tree", replace(cfg, seed=1000 + seed), n=2)
        counts[x1, x2] += 1
    _check(joint.flatten() * n, counts.flatten())


@pytest.mark.parametrize("greedy", [True, False])
def test_a_draft_with_a_cut_head_proposes_its_rows_alone(tmp_path, greedy):
    """A draft keeping its head's first `cut` rows (FR-Spec) gives logits that wide, and its trees stay inside them,
    greedy or sampled (its candidates ranked by the scores the target's choice is the argmax of)."""
    from formats.convert import convert
    from formats.source_hf import HFSource
    from formats.store import WeightStore
    from formats.weights import StreamingWeights
    from tests.conftest import TINY
    from tests.models.tiny_files import write_hf_dir

    args, cut = TINY["qwen"], 120
    store = WeightStore(
        convert(HFSource(write_hf_dir(tmp_path / "hf", args, random_tensors(args, seed=4))), tmp_path / "s", "int4")
    )
    draft = Transformer(store.args, StreamingWeights(store, set(store.group_names()) - {"embed"}, head_rows=cut))
    sampling = SamplingConfig() if greedy else SamplingConfig(temperature=1.5, repetition_penalty=1.2)
    cfg = TreeConfig(mode="tree", width=6, branch_threshold=0.01, alpha=0.0, trie=False, adaptive=False)
    drafter = Drafter(draft, sampling, cfg)
    drafter.start([3, 17, 5, 9], 32)
    drafter.push([11])
    d = drafter.build_tree()
    assert len(d.tree) > 2 and all(n.token < cut for n in d.tree.nodes[1:])
    assert draft.forward(torch.tensor([3, 5]), torch.arange(2), draft.new_cache(4)).shape == (2, cut)


@pytest.mark.parametrize(
    "cfg", [SamplingConfig(logprobs=3), SamplingConfig(temperature=0.8, seed=4, logprobs=0)], ids=["greedy", "sampled"]
)
def test_each_tokens_log_probabilities_are_the_target_alones_in_every_mode(pair, cfg):
    """A token's log-probability and its likeliest alternatives come from the row that chose it: a tree's and a
    chain's rows give the target alone's, to the bit, and one entry for each token generated."""
    runs = {}
    for mode in ("target", "tree", "chain"):
        tree = TreeConfig(mode="chain" if mode == "chain" else "tree", width=6, chain_k=3, trie=False, adaptive=False)
        loop = Speculation(LocalTarget(pair[0]), LocalDraft(pair[1]), mode, tree, cfg, 96)
        g = loop.generate(PROMPT, 20, set())
        runs[mode] = (g.new_ids, g.stats["logprobs"])
    ids, entries = runs["target"]
    assert runs["tree"] == runs["chain"] == runs["target"]
    assert [e[0] for e in entries] == ids and all(len(e[2]) == cfg.logprobs for e in entries)
    assert all(e[1] <= 0 for e in entries) and (not cfg.greedy or all(e[2][0][1] == e[1] for e in entries))
