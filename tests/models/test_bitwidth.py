"""Expert-wise bitwidths (EdgeMoE §3.2) on a tiny mixture of experts: the chosen mix stays within the
tolerated loss as measured afresh, a larger tolerance lowers more experts, the least important go
first, and `launch models expert-bits` writes a store whose experts carry their formats."""

import dataclasses

import pytest
import torch

from formats.bitwidth import LEVELS, MixedExperts, choose_bitwidths, quantize_experts
from models.transformer import Transformer
from formats.weights import TensorWeights, random_tensors
from tests.models.tiny_moe import ARCHS

ARGS = dataclasses.replace(
    ARCHS["qwen3_moe"], dim=128, n_heads=4, head_dim=32, n_layers=2, n_experts=8, n_experts_used=2, expert_ffn_dim=128
)


@pytest.fixture(scope="module")
def setup():
    t = random_tensors(ARGS, seed=9, scale=1.5)
    mixed = MixedExperts(TensorWeights(ARGS, t, "int4"), quantize_experts(t.__getitem__, ARGS)[0])
    g = torch.Generator().manual_seed(4)
    calibration = [torch.randint(0, ARGS.vocab_size, (48,), generator=g) for _ in range(3)]
    return Transformer(ARGS, mixed), mixed, calibration


def measured_loss(model, mixed, calibration, formats) -> float:
    mixed.choice, mixed.default = {}, "int8"
    ref = [model.forward(c, torch.arange(len(c)), model.new_cache(len(c))).argmax(-1) for c in calibration]
    mixed.choice = formats
    got = [model.forward(c, torch.arange(len(c)), model.new_cache(len(c))).argmax(-1) for c in calibration]
    mixed.choice = {}
    return 1 - sum(int((a == b).sum()) for a, b in zip(got, ref)) / sum(len(r) for r in ref)


def test_the_chosen_mix_is_within_the_tolerance_and_more_tolerance_lowers_more_experts(setup):
    model, mixed, calibration = setup
    small = choose_bitwidths(model, mixed, calibration, 0.02)
    large = choose_bitwidths(model, mixed, calibration, 0.2)
    assert small.uniform_loss["int2"] > small.uniform_loss["int4"] >= 0.0  # two bits lose more than four
    for choice, tol in ((small, 0.02), (large, 0.2)):
        assert len(choice.formats) == ARGS.n_layers * ARGS.n_experts
        assert choice.loss <= tol
        assert measured_loss(model, mixed, calibration, choice.formats) == pytest.approx(choice.loss)
    low = lambda c: sum(LEVELS.index(f) for f in c.formats.values())
    assert low(large) <= low(small)  # fewer bits in all
    assert choose_bitwidths(model, mixed, calibration, 0.99).formats == {k: "int2" for k in small.formats}
    per_expert = {"int2": 1, "int4": 2, "int8": 4}
    assert large.bytes_saved(per_expert) >= small.bytes_saved(per_expert)


def test_a_bad_tolerance_is_refused(setup):
    model, mixed, calibration = setup
    with pytest.raises(ValueError, match="tolerable accuracy loss"):
        choose_bitwidths(model, mixed, calibration, 1.5)


def test_two_levels_measure_against_the_higher_one(setup):
    model, mixed, calibration = setup
    choice = choose_bitwidths(model, mixed, calibration, 0.1, levels=("int2", "int4"))
    assert set(choice.formats.values()) <= {"int2", "int4"} and choice.uniform_loss["int4"] == 0.0
    assert choice.loss <= 0.1
