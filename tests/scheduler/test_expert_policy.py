"""Expert-buffer policies on hand-made routing traces: eviction order, path profile, replayed hit counts."""

import json
import random

import pytest

from common.errors import CadenceError
from scheduler.generation.expert_policy import LRU, EdgeMoEEviction, PathStats, SimResult, make_eviction, simulate


class MRU:
    """Most recently used first: a policy that would evict the running layer's experts if allowed."""

    def __init__(self):
        self.lru = LRU()

    def use(self, key):
        self.lru.use(key)

    def order(self, cached, layer):
        last = self.lru._last
        return sorted(cached, key=lambda k: -last.get(k, 0))


# -- eviction order ----------------------------------------------------------------------------------


def test_lru_evicts_the_least_recently_used_first():
    p = LRU()
    for k in [(0, 1), (1, 2), (0, 3), (0, 1), (2, 0)]:
        p.use(k)
    cached = {(0, 1), (1, 2), (0, 3), (2, 0), (3, 7)}
    # (3, 7) never used: first; then by last use: (1,2)@2, (0,3)@3, (0,1)@4, (2,0)@5
    assert p.order(cached, layer=4) == [(3, 7), (1, 2), (0, 3), (0, 1), (2, 0)]
    # the running layer's experts go last
    assert p.order(cached, layer=0) == [(3, 7), (1, 2), (2, 0), (0, 3), (0, 1)]


def test_edgemoe_order_follows_frequency_times_layers_since_last_run():
    # S = 4, running layer I = 1: (S - i + I) mod S is 1 for layer 0 (just ran, next runs furthest ahead),
    # 2 for layer 3, 3 for layer 2 (runs next). Keep score f * that; the lowest goes first:
    # (2,1): 0.1*3 = 0.3, (3,0): 0.2*2 = 0.4, (0,0): 0.9*1 = 0.9, (2,0): 0.5*3 = 1.5; layer 1's expert last.
    freq = {(0, 0): 0.9, (2, 0): 0.5, (3, 0): 0.2, (2, 1): 0.1, (1, 5): 0.0}
    uses = [(2, 0), (3, 0), (2, 1), (0, 0), (1, 5)]
    edge, lru = EdgeMoEEviction(4, 8, freq), LRU()
    for k in uses:
        edge.use(k)
        lru.use(k)
    cached = set(freq)
    assert edge.order(cached, layer=1) == [(2, 1), (3, 0), (0, 0), (2, 0), (1, 5)]
    assert lru.order(cached, layer=1) == [(2, 0), (3, 0), (2, 1), (0, 0), (1, 5)]
    assert edge.score((2, 0), 1) == pytest.approx(1.5) and edge.score((0, 0), 1) == pytest.approx(0.9)
    # one layer later (I = 2) layer 0 is 2 layers since, layer 3 runs next (3), layer 2 is running:
    # (0,0): 0.9*2 = 1.8, (3,0): 0.2*3 = 0.6, (1,5): 0*1 = 0 -> (1,5), (3,0), (0,0), then layer 2 by f: (2,1), (2,0)
    assert edge.order(cached, layer=2) == [(1, 5), (3, 0), (0, 0), (2, 1), (2, 0)]


def test_edgemoe_counts_frequency_online_without_a_prior():
    edge = EdgeMoEEviction(2, 4)
    for k in [(0, 1)] * 3 + [(0, 2)] + [(0, 3)] * 2:
        edge.use(k)
    assert edge.frequency((0, 1)) == pytest.approx(0.5)
    # same layer distance for all (layer 0 seen from layer 1): the rarest first, the never-used (0,0) before all
    assert edge.order({(0, 0), (0, 1), (0, 2), (0, 3)}, layer=1) == [(0, 0), (0, 2), (0, 3), (0, 1)]


def test_make_eviction_names_and_refusal():
    assert isinstance(make_eviction("lru", 2, 4), LRU)
    stats = PathStats(2, 4)
    stats.add([[1], [2]])
    edge = make_eviction("edgemoe", 2, 4, stats)
    assert isinstance(edge, EdgeMoEEviction) and edge.frequency((1, 2)) == 1.0 and edge.frequency((1, 1)) == 0.0
    with pytest.raises(ValueError, match="choose 'lru' or 'edgemoe'"):
        make_eviction("fifo", 2, 4)
    with pytest.raises(ValueError, match="re-profile"):
        make_eviction("edgemoe", 3, 4, stats)


# -- path profile ------------------------------------------------------------------------------------


def xor_trace():
    """Layer 2 is 2 + (layer 0 xor layer 1): only the pair of previous layers determines it."""
    return [[[a], [b], [2 + (a ^ b)]] for a in (0, 1) for b in (0, 1)] * 5


def test_pathstats_predicts_the_path_correlated_expert():
    stats = PathStats(3, 4)
    for path in xor_trace():
        stats.add(path)
    for a in (0, 1):
        for b in (0, 1):
            assert stats.predict(2, [b], [a], 1) == [(2 + (a ^ b), 1.0)]
    # layer 1 alone says nothing: 50/50, lower id first
    assert stats.predict(2, [0], None, 2) == [(2, 0.5), (3, 0.5)]


def skewed_stats():
    stats = PathStats(3, 6)
    for _ in range(3):
        stats.add([[0], [1], [4]])
    stats.add([[1], [2], [5]])
    stats.add([[2], [2], [3]])
    stats.add([[0], [3], [3]])
    return stats


def test_pathstats_backs_off_to_the_previous_layer_then_to_the_marginal():
    stats = skewed_stats()
    # (prev2 {0}, prev1 {2}) never seen; prev1 {2} was: experts 5 and 3 once each out of 2 tokens
    assert stats.predict(2, [2], [0], 2) == [(3, 0.5), (5, 0.5)]
    # prev1 {5} never seen at layer 1: the layer-2 marginal over 6 tokens: 4 x3, 3 x2, 5 x1
    assert stats.predict(2, [5], [0], 3) == [(4, 0.5), (3, pytest.approx(2 / 6)), (5, pytest.approx(1 / 6))]
    # layer 0 has no previous layer: its marginal
    assert stats.predict(0, [], None, 2) == [(0, pytest.approx(4 / 6)), (1, pytest.approx(1 / 6))]
    # layer 1 uses prev1 only (prev2 ignored)
    assert stats.predict(1, [0], [3], 1) == [(1, 0.75)]
    # too few experts under a seen key: the rest from the next level, no repeats, never-seen experts never named
    assert stats.predict(2, [1], [0], 3) == [(4, 1.0), (3, pytest.approx(2 / 6)), (5, pytest.approx(1 / 6))]
    assert len(stats.predict(2, [1], [0], 6)) == 3


def test_pathstats_frequency_is_the_fraction_of_tokens():
    freq = skewed_stats().frequency()
    assert freq[(0, 0)] == pytest.approx(4 / 6) and freq[(2, 4)] == pytest.approx(0.5) and (2, 0) not in freq


def test_pathstats_top_k_keys_are_sets_and_paths_are_checked():
    stats = PathStats(2, 4)
    stats.add([[3, 1], [2, 0]])
    assert stats.predict(1, [1, 3], None, 2) == [(0, 1.0), (2, 1.0)]
    with pytest.raises(ValueError, match="layers"):
        stats.add([[1]])
    with pytest.raises(ValueError, match="0..3"):
        stats.add([[1], [4]])


def test_pathstats_json_round_trip(tmp_path):
    stats = skewed_stats()
    for path in [[[0, 5], [1, 2], [3, 4]], [[5, 0], [2, 1], [4, 3]]]:
        stats.add(path)
    d = stats.to_json()
    assert "2|0,5|1,2" in d["counts"]  # compact keys
    back = PathStats.from_json(json.loads(json.dumps(d)))
    assert back.to_json() == d and back.frequency() == stats.frequency()
    for layer, prev1, prev2 in [(2, [1, 2], [0, 5]), (2, [2], [0]), (1, [0], None), (0, [], None)]:
        assert back.predict(layer, prev1, prev2, 4) == stats.predict(layer, prev1, prev2, 4)
    stats.save(tmp_path / "paths.json")
    assert PathStats.load(tmp_path / "paths.json").to_json() == d


@pytest.mark.parametrize(
    "text",
    [
        "{not json",
        '{"format": "something else"}',
        "",
        '{"format": "cadence.expert-paths", "version": 1, "n_layers": 2, "n_experts": 4, "counts": {"7||": [1, 0, 1]}}',
    ],
)
def test_damaged_profile_says_to_reprofile(tmp_path, text):
    p = tmp_path / "paths.json"
    p.write_text(text)
    with pytest.raises(CadenceError, match="damaged.*re-profile"):
        PathStats.load(p)


def test_missing_profile_says_to_reprofile(tmp_path):
    with pytest.raises(CadenceError, match="missing.*re-profile"):
        PathStats.load(tmp_path / "nope.json")


# -- simulation --------------------------------------------------------------------------------------


def test_lru_hit_counts_on_a_tiny_trace():
    # keys in order: (0,0) (1,0) | (0,1) (1,0) | (0,0) (1,1) | (0,0) (1,0); capacity 3:
    # miss miss | miss hit | hit, miss evicting (0,1) | hit hit
    trace = [[[0], [0]], [[1], [0]], [[0], [1]], [[0], [0]]]
    r = simulate(trace, 3, LRU(), expert_bytes=10)
    assert (r.hits, r.misses, r.preloaded, r.preload_hits, r.bytes_read) == (4, 4, 0, 0, 40)
    assert r.hit_rate == 0.5
    # capacity 2: every access misses (four distinct keys, each reused after two others)
    assert simulate(trace, 2, LRU()).misses == 7


def hot_cold_trace(n):
    """Even tokens use the hot expert 0 at both layers, odd tokens a cold one seen rarely."""
    return [[[0], [0]] if t % 2 == 0 else [[1 + (t // 2) % 7]] * 2 for t in range(n)]


def test_edgemoe_keeps_hot_experts_that_lru_evicts():
    trace = hot_cold_trace(20)
    stats = PathStats(2, 8)
    for path in trace:
        stats.add(path)
    # LRU, capacity 3: (0,0) comes back after (1,0), (0,c), (1,c): always gone
    lru = simulate(trace, 3, LRU())
    assert (lru.hits, lru.misses) == (0, 40)
    # EdgeMoE: the cold expert of the other layer always scores lowest, the two hot ones stay
    edge = simulate(trace, 3, make_eviction("edgemoe", 2, 8, stats))
    assert (edge.hits, edge.misses) == (18, 22)
    # counted online, the first hot and cold uses tie (then LRU goes first): the hot experts settle from token 4
    online = simulate(trace, 3, make_eviction("edgemoe", 2, 8))
    assert (online.hits, online.misses) == (16, 24)


def test_used_experts_of_the_running_layer_are_never_evicted():
    # MRU would evict the expert the layer just read; simulate skips it and takes the next victim.
    # capacity 3, two layers of [0, 1]: token 0 misses 4 times, then each token hits (l,0) and misses (l,1).
    trace = [[[0, 1], [0, 1]]] * 5
    r = simulate(trace, 3, MRU())
    assert (r.hits, r.misses) == (8, 12)
    # one layer: the layer's own unneeded experts are the only victims; the needed one stays
    r = simulate([[[0, 1]], [[2, 3]], [[2, 3]]], 2, MRU())
    assert (r.hits, r.misses) == (2, 4)


def test_capacity_below_the_layer_top_k_is_refused():
    with pytest.raises(ValueError, match="cannot hold the 2 experts one layer uses.*at least 2"):
        simulate([[[0, 1], [2]]], 1, LRU())
    with pytest.raises(ValueError, match="preload profile or a lookahead"):
        simulate([[[0]]], 1, LRU(), preload=PathStats(1, 1), preload_k=1, lookahead=[[[0]]])


def chain_trace(n):
    """Layer 0 cycles through experts 0..3; each later layer is fixed by the one before."""
    trace = []
    for t in range(n):
        path = [[t % 4]]
        for layer in (1, 2, 3):
            path.append([(3 * path[-1][0] + layer) % 8])
        trace.append(path)
    return trace


def test_preload_with_a_perfect_profile_turns_misses_into_preload_hits():
    T = 40
    trace = chain_trace(T)
    stats = PathStats(4, 8)
    for path in trace:
        stats.add(path)
    plain = simulate(trace, 2, LRU())
    assert (plain.hits, plain.misses) == (0, 4 * T)
    r = simulate(trace, 2, LRU(), preload=stats, preload_k=1)
    # layers 1..3 are always predicted right; layer 0's marginal guess (expert 0) is right one token in four
    assert r.preloaded == 4 * T
    assert r.preload_hits == r.hits == 3 * T + T // 4
    assert r.misses == 3 * T // 4
    assert r.bytes_read == r.preloaded + r.misses


def test_lookahead_with_the_true_experts_never_misses():
    rng = random.Random(7)
    trace = [[rng.sample(range(8), 2) for _ in range(4)] for _ in range(200)]
    r = simulate(trace, 4, LRU(), lookahead=trace, expert_bytes=3)
    assert r.misses == 0 and r.hits == 200 * 4 * 2
    assert r.preload_hits == r.preloaded > 0 and r.bytes_read == 3 * r.preloaded
    # a wrong guess only costs reads: the real experts still miss
    wrong = [[[(e + 1) % 8 for e in layer] for layer in tok] for tok in trace]
    bad = simulate(trace, 4, LRU(), lookahead=wrong)
    assert bad.misses > 0 and bad.bytes_read == bad.preloaded + bad.misses


@pytest.mark.parametrize("capacity", [16, 32])
@pytest.mark.parametrize("policy", ["lru", "edgemoe"])
def test_uniform_random_routing_hits_about_capacity_over_experts(capacity, policy):
    # random routing is a hard case for any cache: nothing predicts the next expert
    rng = random.Random(1234)
    n_layers, n_experts = 4, 16
    trace = [[rng.sample(range(n_experts), 2) for _ in range(n_layers)] for _ in range(2000)]
    r = simulate(trace, capacity, make_eviction(policy, n_layers, n_experts))
    assert isinstance(r, SimResult)
    # a little under C/N for LRU: the layers run in a cycle, so the arriving layer is always the oldest held
    assert abs(r.hit_rate - capacity / (n_layers * n_experts)) < 0.05
