"""The speculation cycle over the actors with tiny random models, in seconds: real processes, real
arena, real loader reads; every mode, resident and streamed, gives the target's own tokens.

The slow real-model tests (test_lossless_real, test_memory_wall, test_lean_runtime) check the same
on trained models; these cover the actor path of speculative/loop.py on every run of the suite.
"""

import dataclasses

import pytest
import torch

from common.settings import SamplingConfig, TreeConfig
from formats import loading
from formats.convert import convert
from formats.source import GGUFSource
from formats.store import WeightStore
from formats.weights import random_tensors
from scheduler.runtime_config import MemoryConfig, PipelineConfig, RuntimeConfig, TraceConfig
from scheduler.generation.memplan import Overheads, plan_memory
from scheduler.runtime import Runtime
from scheduler.generation.session import ActorSession, SessionSpec
from speculative.generate import generate_speculative, generate_target
from tests.conftest import TINY
from tests.models.tiny_files import write_gguf

N = 40
GREEDY = SamplingConfig()


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """A target, a draft that is the target's own weights (accepts nearly all) and an unrelated draft
    (accepts almost nothing), int4 as a run under a budget uses."""
    d = tmp_path_factory.mktemp("tiny")
    args = dataclasses.replace(TINY["qwen"], n_layers=4)
    out = {}
    for name, seed in (("target", 3), ("other", 4)):
        src = GGUFSource(write_gguf(d / f"{name}.gguf", args, random_tensors(args, seed=seed)))
        out[name] = WeightStore(convert(src, d / name, "int4"))
    return out


@pytest.fixture(scope="module")
def prompt():
    g = torch.Generator().manual_seed(7)
    base = torch.randint(3, 300, (12,), generator=g).tolist()
    return base + base[:6]  # a repeat: the trie has something to find


def plain_decode(lm, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding straight on the model, one token a forward, none of speculative/'s code: what
    `generate_target` (the reference of every lossless test) must itself equal."""
    model = lm.model
    cache = model.new_cache(len(prompt) + n)
    logits = model.forward(torch.tensor(prompt), torch.arange(len(prompt)), cache)[-1]
    cache.commit()
    out = []
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = model.forward(torch.tensor(out[-1:]), torch.tensor([cache.length]), cache)[0]
        cache.commit()
    return out


@pytest.fixture(scope="module")
def reference(stores, prompt):
    lm = loading.load_store(stores["target"])
    ids = generate_target(lm, prompt, N, GREEDY, stop_at_eos=False).new_ids
    assert ids == plain_decode(lm, prompt, N)
    return ids


def _run(stores, draft: str | None, mode: str = "tree", plan=None) -> tuple[Runtime, ActorSession]:
    t = stores["target"]
    mem = MemoryConfig(
        budget_bytes=8 << 30,
        arena_bytes=max(64 << 20, plan.stream_bytes + (8 << 20)) if plan else 64 << 20,
        stream_bytes=plan.stream_bytes if plan else 0,
        sample_s=0,
    )
    pipe = PipelineConfig(layer_bytes=plan.slot_bytes if plan else 1 << 20)
    s = Runtime(RuntimeConfig(memory=mem, pipeline=pipe, trace=TraceConfig(enabled=False))).__enter__()
    try:
        spec = ActorSession(
            s,
            SessionSpec(
                mode,
                str(t.dir),
                t.args,
                str(stores[draft].dir) if draft else None,
                GREEDY,
                TreeConfig(ahead=2),
                1,
                256,
                plan=plan,
            ),
        )
    except BaseException:
        s.shutdown()
        raise
    return s, spec


def _generate(spec, prompt, **kw):
    return spec.loop.generate(prompt, N, set(), **kw)


def test_every_mode_over_resident_actors_gives_the_targets_tokens(stores, prompt, reference):
    s, spec = _run(stores, "target")
    try:
        assert _generate(spec, prompt, mode="target").new_ids == reference
        for mode in ("chain", "tree"):
            cfg = TreeConfig(mode=mode, ahead=2)
            g = _generate(spec, prompt, mode=mode, cfg=cfg)
            assert g.new_ids == reference, mode
            assert g.stats["verifications"] > 0 and g.stats["accepted"] > 0, (mode, g.stats)
        again = _generate(
            spec, prompt, mode="tree"
        )  # a second prompt: the governor carries over, the caches start afresh
        assert again.new_ids == reference
        sampled = _generate(spec, prompt, mode="tree", sampling=SamplingConfig(temperature=0.8, seed=1))
        assert len(sampled.new_ids) == N and all(0 <= t < 300 for t in sampled.new_ids)
    finally:
        spec.close()
        s.shutdown()


def test_a_draft_that_is_mostly_wrong_and_the_trie_alone_are_lossless(stores, prompt, reference):
    for draft in ("other", None):
        s, spec = _run(stores, draft)
        try:
            g = _generate(spec, prompt)
            assert g.new_ids == reference, draft
            assert g.stats["target_forwards"] < N + 1 or draft == "other", g.stats  # the trie found the repeats
        finally:
            spec.close()
            s.shutdown()


def test_streamed_layers_through_the_loader_give_the_targets_tokens(stores, prompt, reference):
    t = stores["target"]
    groups = {g: t.groups[g].nbytes for g in t.group_names() if g != "embed"}
    o = Overheads(**{f.name: 0 for f in dataclasses.fields(Overheads)})
    plan = plan_memory(sum(groups.values()) * 3 // 4, groups, 0, 0, 0, overheads=o)
    assert plan.streamed and plan.resident  # some layers come from disk every forward
    s, spec = _run(stores, "target", plan=plan)
    try:
        for mode in ("target", "tree"):
            g = _generate(spec, prompt, mode=mode)
            assert g.new_ids == reference, mode
            assert g.stats["loads"] >= len(plan.streamed) and g.stats["bytes_read"] > 0, g.stats
        assert s.stream_slots.peak_bytes <= plan.stream_bytes
    finally:
        spec.close()
        s.shutdown()


def test_in_process_modes_match_the_actor_path(stores, prompt, reference):
    target, draft = loading.load_store(stores["target"]), loading.load_store(stores["other"])
    for d, cfg in ((draft, TreeConfig()), (draft, TreeConfig(mode="chain")), (None, TreeConfig())):
        assert generate_speculative(target, d, prompt, N, GREEDY, cfg, stop_at_eos=False).new_ids == reference
