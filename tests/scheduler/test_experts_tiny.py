"""A mixture of experts under a budget over the actors, with tiny random models: the experts come from
disk through the loader into the expert buffer, every policy gives the resident model's tokens, the
buffer stays within its bound, and a loader killed mid-expert ends the run with one reason."""

import dataclasses
import os
import signal

import pytest
import torch

from common.errors import CadenceError
from common.settings import ExpertOptions, SamplingConfig, TreeConfig
from formats import loading
from formats.convert import convert
from models.routing import trace_paths
from formats.source_hf import HFSource
from formats.store import WeightStore
from formats.weights import random_tensors
from scheduler.runtime_config import MemoryConfig, PipelineConfig, RuntimeConfig, TraceConfig
from scheduler.generation.expert_policy import PathStats
from scheduler.generation.memplan import Overheads, plan_memory
from scheduler.generation.session import ActorSession, SessionSpec
from scheduler.runtime import Runtime
from speculative.generate import generate_target
from tests.models.tiny_moe import ARCHS, write_hf

N = 24
GREEDY = SamplingConfig()
ARGS = dataclasses.replace(ARCHS["qwen3_moe"], n_layers=3, n_experts=16, n_experts_used=2, expert_ffn_dim=64)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    d = tmp_path_factory.mktemp("moe")
    return WeightStore(
        convert(HFSource(write_hf(d / "hf", ARGS, random_tensors(ARGS, seed=2, scale=1.5))), d / "store", "int4")
    )


@pytest.fixture(scope="module")
def prompt():
    g = torch.Generator().manual_seed(3)
    base = torch.randint(3, 300, (10,), generator=g).tolist()
    return base + base[:5]


@pytest.fixture(scope="module")
def reference(store, prompt):
    return generate_target(loading.load_store(store), prompt, N, GREEDY, stop_at_eos=False).new_ids


@pytest.fixture(scope="module")
def profile(store, prompt):
    st = PathStats(ARGS.n_layers, ARGS.n_experts)
    for path in trace_paths(loading.load_store(store).model, prompt[::-1], 30):
        st.add(path)
    return st


def moe_plan(store, share: float):
    """A plan whose expert buffer holds about `share` of the experts (no overheads: the tiny model's bytes only)."""
    groups = {g: store.groups[g].nbytes for g in store.group_names() if g.startswith(("layer.", "head."))}
    experts = {g: store.groups[g].nbytes for g in store.group_names() if g.startswith("expert.")}
    o = Overheads(**{f.name: 0 for f in dataclasses.fields(Overheads)})
    budget = sum(-(-n // 4096) * 4096 for n in groups.values()) + int(
        share * sum(-(-n // 4096) * 4096 for n in experts.values())
    )
    return plan_memory(budget, groups, 0, 0, 0, overheads=o, experts=experts, experts_used=ARGS.n_experts_used)


def run(store, plan, mode="target", draft=None, eviction="lru", preload="none", profile=None):
    mem = MemoryConfig(
        budget_bytes=8 << 30,
        arena_bytes=plan.stream_bytes + (8 << 20),
        stream_bytes=plan.stream_bytes,
        expert_bytes=plan.expert_buffer,
        sample_s=0,
    )
    s = Runtime(
        RuntimeConfig(
            memory=mem,
            pipeline=PipelineConfig(layer_bytes=plan.slot_bytes or 1 << 20),
            trace=TraceConfig(enabled=False),
        )
    ).__enter__()
    try:
        spec = ActorSession(
            s,
            SessionSpec(
                mode,
                str(store.dir),
                store.args,
                str(draft.dir) if draft else None,
                GREEDY,
                TreeConfig(),
                1,
                200,
                plan=plan,
                experts=ExpertOptions(eviction, preload),
                paths=profile,
            ),
        )
    except BaseException:
        s.shutdown()
        raise
    return s, spec


def test_the_plan_keeps_non_expert_groups_resident_and_gives_the_rest_to_the_buffer(store):
    plan = moe_plan(store, 0.25)
    assert not plan.streamed and plan.experts == ARGS.n_layers * ARGS.n_experts
    assert plan.expert_slots >= ARGS.n_experts_used and plan.expert_buffer <= plan.budget - plan.resident_bytes
    assert "expert buffer" in plan.report() and "experts read on demand" in plan.summary()
    tight = moe_plan(
        store, 0.0
    )  # no room beside the resident groups: layers stream, the buffer holds one token's experts
    assert tight.streamed and tight.expert_slots >= ARGS.n_experts_used and tight.total <= tight.budget
    assert tight.stream_bytes == tight.slot_bytes * tight.n_slots + tight.expert_buffer
    with pytest.raises(CadenceError, match="too small.*one token's experts.*the smallest budget that works is"):
        plan_memory(
            8192,
            {g: store.groups[g].nbytes for g in store.group_names() if g.startswith(("layer.", "head."))},
            0,
            0,
            0,
            overheads=Overheads(**{f.name: 0 for f in dataclasses.fields(Overheads)}),
            experts={g: store.groups[g].nbytes for g in store.group_names() if g.startswith("expert.")},
            experts_used=2,
        )


@pytest.mark.parametrize(
    "eviction,preload", [("none", "none"), ("lru", "none"), ("lru", "router"), ("edgemoe", "paths")]
)
def test_every_policy_gives_the_resident_models_tokens_within_the_buffer(
    store, prompt, reference, profile, eviction, preload
):
    plan = moe_plan(store, 0.4)
    s, spec = run(
        store,
        plan,
        eviction=eviction,
        preload=preload,
        profile=profile if preload == "paths" or eviction == "edgemoe" else None,
    )
    try:
        g = spec.loop.generate(prompt, N, set())
        assert g.new_ids == reference
        st = g.stats
        assert st["expert_misses"] > 0 and st["expert_bytes_read"] > 0 and st["expert_reads"] >= st["expert_misses"], st
        assert s.expert_slots.peak_bytes <= plan.expert_buffer
        if eviction == "none":
            assert st["expert_hits"] == 0 and st["expert_preloads"] == 0, st
        else:
            assert st["expert_hits"] > 0, st
        if preload != "none":
            assert st["expert_preloads"] > 0, st
    finally:
        spec.close()
        s.shutdown()
    assert s.expert_slots.used_bytes == 0


def test_a_tree_verification_fetches_the_union_of_its_tokens_experts_and_stays_lossless(store, prompt, reference):
    plan = moe_plan(store, 0.3)
    s, spec = run(store, plan, mode="tree", draft=store, eviction="lru", preload="router")
    try:
        g = spec.loop.generate(prompt, N, set())
        assert g.new_ids == reference
        assert g.stats["accepted"] > 0 and g.stats["expert_requests"] > 0
    finally:
        spec.close()
        s.shutdown()


def test_streamed_layers_and_experts_share_the_loader(store, prompt, reference):
    plan = moe_plan(store, 0.0)
    s, spec = run(store, plan, mode="tree", draft=store, eviction="lru", preload="router")
    try:
        g = spec.loop.generate(prompt, N, set())
        assert g.new_ids == reference
        assert g.stats["loads"] > 0 and g.stats["expert_reads"] > 0, g.stats
        assert (
            s.expert_slots.peak_bytes <= plan.expert_buffer
            and s.stream_slots.peak_bytes <= plan.slot_bytes * plan.n_slots
        )
    finally:
        spec.close()
        s.shutdown()


def test_a_buffer_smaller_than_a_layers_union_takes_it_in_parts(store, prompt, reference):
    plan = dataclasses.replace(
        moe_plan(store, 0.4),
        expert_buffer=ARGS.n_experts_used
        * max(store.groups[g].nbytes for g in store.group_names() if g.startswith("expert."))
        // 4096
        * 4096
        + 4096 * ARGS.n_experts_used,
    )
    assert plan.expert_slots == ARGS.n_experts_used
    s, spec = run(store, plan, mode="tree", draft=store, eviction="lru", preload="none")
    try:
        assert spec.loop.generate(prompt, N, set()).new_ids == reference
        assert s.expert_slots.peak_bytes <= plan.expert_buffer
    finally:
        spec.close()
        s.shutdown()


def test_a_loader_killed_mid_expert_ends_the_run_with_one_reason_and_leaves_nothing(store, prompt):
    plan = moe_plan(store, 0.25)
    s, spec = run(store, plan, eviction="none", preload="none")
    pid = s.actors["loader"].pid
    killed = []

    def on_cycle(_):
        if not killed:
            killed.append(os.kill(pid, signal.SIGKILL))

    try:
        with pytest.raises(CadenceError, match="loader"):
            spec.loop.generate(prompt, N, set(), on_cycle=on_cycle)
    finally:
        spec.close()
        s.shutdown()
    assert killed and not [f for f in os.listdir("/dev/shm") if s.run_id in f]


def test_in_process_speculation_on_a_mixture_of_experts_is_lossless(store, prompt, reference):
    from speculative.generate import generate_speculative

    target = loading.load_store(store)
    for cfg in (TreeConfig(), TreeConfig(mode="chain")):
        g = generate_speculative(target, target, prompt, N, GREEDY, cfg, stop_at_eos=False)
        assert g.new_ids == reference and g.stats["accepted"] > 0, cfg.mode
