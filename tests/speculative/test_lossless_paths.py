"""Lossless on the real pair on every kernel path this host has (models/kernels.py): chain and tree drafting,
in process, give the target's own token ids, and the target's ids are the same on every path (the paths
compute the same bits). A path this CPU lacks is skipped with its name."""

import pytest

from engine.prompts import Prompt, encode_prompt
from models import kernels
from models.sampling import SamplingConfig
from common.settings import TreeConfig
from speculative.generate import generate_speculative, generate_target
from tests.conftest import dev_prompts, real_model
from tests.models.test_kernel_paths import path_lib

pytestmark = [pytest.mark.real]
N = 24
FMT = "int4"
PROMPTS = ("fib", "rewrite_hints")  # a completion and a copy
PORTABLE_N = 6  # the portable path runs the 1.5B at ~0.5 s a token: its tokens only, fewer of them


@pytest.fixture(scope="module")
def pair():
    return real_model("qwen2.5-coder-1.5b", FMT), real_model("qwen2.5-coder-0.5b", FMT)


@pytest.fixture(scope="module")
def prompts(pair):
    tok = pair[0].tokenizer
    return {
        p["id"]: encode_prompt(tok, Prompt(p["id"], p["kind"], p["prompt"]), "auto")[0]
        for p in dev_prompts()
        if p["id"] in PROMPTS
    }


@pytest.fixture(scope="module")
def reference(pair, prompts):
    """The target alone on the path this process chose."""
    return {pid: generate_target(pair[0], ids, N, SamplingConfig()).new_ids for pid, ids in prompts.items()}


@pytest.mark.parametrize("name", [p.name for p in kernels.PATHS])
def test_each_path_gives_the_same_tokens_and_speculation_keeps_them(name, pair, prompts, reference):
    target, draft = pair
    with kernels.using(path_lib(name)):
        if name == "portable":
            pid = PROMPTS[0]
            assert (
                generate_target(target, prompts[pid], PORTABLE_N, SamplingConfig()).new_ids
                == reference[pid][:PORTABLE_N]
            )
            return
        for pid, ids in prompts.items():
            assert generate_target(target, ids, N, SamplingConfig()).new_ids == reference[pid], pid
            for cfg in (TreeConfig(mode="chain", chain_k=4), TreeConfig(mode="tree", width=8)):
                got = generate_speculative(target, draft, ids, N, SamplingConfig(), cfg)
                assert got.new_ids == reference[pid], (pid, cfg.mode)
                assert got.stats["verifications"] > 0
