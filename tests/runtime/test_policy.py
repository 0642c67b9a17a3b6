"""The pipeline policy as a pure state machine, driven by a tiny discrete-event simulator."""
from __future__ import annotations

import heapq
import random

import pytest

from scheduler.config import KiB, PartitionConfig, PipelineConfig
from scheduler.policy import Action, Drafted, LayerDone, Loaded, PipelinePolicy, Release

SLOT = 64 * KiB


def make(stream_slots=4, n_layers=8, shares=(0.3, 0.2), **pipe) -> PipelinePolicy:
    cfg = PipelineConfig(n_layers=n_layers, layer_bytes=SLOT, **{"verify_width": 6, "max_tokens": 40, **pipe})
    return PipelinePolicy(cfg, PartitionConfig(*shares), stream_slots * SLOT)


def simulate(policy: PipelinePolicy, seed: int, accept_p: float = 0.7):
    """Each role serves one request at a time (the loader keeps a queue); durations and
    acceptance are random. Returns the log of (start, end, action) and checks invariants."""
    rng = random.Random(seed)
    dur = {"draft_step": (1, 3), "load": (2, 6), "verify_layer": (1, 4), "sparse_attn": (1, 3)}
    free_at = {}  # role -> time its queue drains
    heap, log, held, n = [], [], {}, 0

    def dispatch(items, now):
        nonlocal n
        for it in items:
            if isinstance(it, Release):
                assert it.slot in held, f"release of {it.slot}, which is not allocated"
                del held[it.slot]
                continue
            if it.alloc_bytes:
                assert it.slot not in held
                held[it.slot] = it.alloc_bytes
            assert sum(held.values()) <= policy.stream_bytes, "the loader's memory bound was broken"
            start = max(now, free_at.get(it.role, 0))
            end = start + rng.uniform(*dur[it.op])
            free_at[it.role] = end
            n += 1
            heapq.heappush(heap, (end, n, start, it))

    dispatch(policy.start(), 0.0)
    while heap:
        end, _, start, it = heapq.heappop(heap)
        log.append((start, end, it))
        result = {}
        if it.op == "draft_step":
            result = {"conf": rng.uniform(0.6, 1.0)}
        elif it.op == "verify_layer" and it.args["last"]:
            k = 0
            while k < it.args["tree"] and rng.random() < accept_p:
                k += 1
            result = {"accepted": k}
        dispatch(policy.on(policy.event_for(it, result)), end)
    assert policy.done and not held, f"slots still held at the end: {held}"
    return log


@pytest.mark.parametrize("stream_slots", [2, 3, 5, 16])
def test_pipeline_finishes_within_the_memory_bound(stream_slots, seed):
    for s in range(seed, seed + 10):
        p = make(stream_slots=stream_slots)
        simulate(p, s)
        assert p.tokens >= 40 and p.rounds > 0
        assert p.peak_held <= stream_slots * SLOT and p.held == 0


def test_layers_are_verified_in_order_and_only_after_their_load(seed):
    p = make()
    log = simulate(p, seed)
    loaded_at = {it.args["seq"]: end for _, end, it in log if it.op == "load"}
    verified = [(start, it.args["seq"]) for start, _, it in log if it.op == "verify_layer"]
    assert [s for _, s in verified] == list(range(len(verified)))
    assert all(start >= loaded_at[s] for start, s in verified)
    sparse = [it.args["seq"] for _, _, it in log if it.op == "sparse_attn"]
    assert sparse == [s for _, s in verified]  # each layer's sparse part goes with its dense part
    assert len(verified) == p.rounds * 8


def test_draft_and_verifier_never_compute_at_once_when_they_share_a_unit(seed):
    def overlaps(log):
        d = [(s, e) for s, e, it in log if it.role == "draft"]
        v = [(s, e) for s, e, it in log if it.role == "verifier"]
        return sum(1 for s1, e1 in d for s2, e2 in v if s1 < e2 and s2 < e1)

    assert overlaps(simulate(make(), seed)) == 0
    assert overlaps(simulate(make(draft_shares_unit=False), seed)) > 0  # the flag is what keeps them apart


def test_partition_ratios_reach_the_workers():
    p = make(shares=(0.25, 0.1))
    log = simulate(p, 1)
    v = next(it for _, _, it in log if it.op == "verify_layer")
    s = next(it for _, _, it in log if it.op == "sparse_attn")
    assert v.args["share"] == pytest.approx(0.9)
    assert (s.args["attn_share"], s.args["linear_share"]) == (0.25, 0.1)
    assert not any(it.op == "sparse_attn" for _, _, it in simulate(make(shares=(0.0, 0.0)), 1))


def test_fallback_verifies_once_tree_confidence_drops_below_alpha():
    p = make(stream_slots=2, alpha=0.5, load_depth=1)
    acts = p.start()
    assert [a.op for a in acts] == ["load", "draft_step"]  # loading starts during drafting
    load0, step = acts
    acts = p.on(Drafted(0.9, step.args["epoch"]))  # Tc 0.9 >= alpha: keep drafting
    assert [a.op for a in acts] == ["draft_step"] and p.phase == "draft"
    acts = p.on(Drafted(0.5, 0))  # Tc 0.45 < 0.5: verify this 2-token tree
    assert p.phase == "verify" and p.verify_tree == 2
    assert [a.op for a in acts] == ["draft_step"] and acts[0].args["ahead"]  # draft ahead while layer 0 loads
    acts = p.on(Loaded(0))
    assert [a.op for a in acts] == ["load"]  # the verifier waits: the draft still computes on its unit
    acts = p.on(Drafted(0.9, 0))
    assert [a.op for a in acts] == ["verify_layer", "sparse_attn"] and acts[0].args["tree"] == 2


def test_alpha_adapts_and_a_rejected_tree_discards_the_draft_ahead():
    p = make(stream_slots=2, n_layers=1, alpha=0.5, alpha_step=0.1, load_depth=1)
    p.start()
    p.on(Drafted(0.4, 0))  # fallback at once, tree of 1
    p.on(Loaded(0))
    p.on(Drafted(0.9, 0))  # one token drafted ahead
    p.on(LayerDone(0, "sparse"))
    p.on(LayerDone(0, "dense", accepted=1))  # all accepted: keep the token drafted ahead
    assert p.tokens == 2 and p.alpha == pytest.approx(0.45) and p.tree == 1
    epoch = p.epoch
    p.on(Drafted(0.1, epoch))  # fallback with a 2-token tree
    p.on(Loaded(1))
    p.on(Drafted(0.9, epoch))
    p.on(LayerDone(1, "sparse"))
    acts = p.on(LayerDone(1, "dense", accepted=0))  # rejected: the token drafted ahead is void
    assert p.tokens == 3 and p.alpha == pytest.approx(0.495) and p.tree == 0 and p.epoch == epoch + 1
    step = next(a for a in acts if isinstance(a, Action) and a.op == "draft_step")
    assert step.args["epoch"] == epoch + 1
    p.on(Drafted(0.01, epoch))  # a stale step from the old tree changes nothing
    assert p.tree == 0 and p.phase == "draft"


def test_finishing_releases_prefetched_slots():
    p = make(stream_slots=4, n_layers=2, max_tokens=1, load_depth=4)
    acts = p.start()
    assert sum(a.op == "load" for a in acts) == 4 and p.held == 4 * SLOT
    for seq in range(4):
        p.on(Loaded(seq))
    p.on(Drafted(0.01, 0))
    for seq in range(2):
        p.on(LayerDone(seq, "sparse"))
        out = p.on(LayerDone(seq, "dense", accepted=0 if seq else None))
    assert p.done and {r.slot for r in out if isinstance(r, Release)} == {"s1", "s2", "s3"}
    assert p.held == SLOT  # load 4 started when slot s0 came back; it is still in flight
    assert p.on(Loaded(4)) == [Release("s4")] and p.held == 0  # released as soon as it lands
    assert p.on(Drafted(0.5, 0)) == []


def test_unknown_event_and_op_are_errors():
    p = make()
    with pytest.raises(TypeError, match="unknown pipeline event"):
        p.on("loaded")
    with pytest.raises(ValueError, match="no pipeline event for op 'x'"):
        p.event_for(Action("draft", "x"), {})
