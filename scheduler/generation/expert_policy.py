"""Which experts a mixture-of-experts buffer keeps, and which it reads ahead: pure policies, no I/O.

Keys are (layer, expert). An eviction policy hears every expert a forward uses (`use`) and ranks
the held ones, the first to evict first (`order`): `LRU`, or `EdgeMoEEviction` (EdgeMoE §3.3.3:
activation frequency times how soon the expert's layer runs again). `PathStats` is EdgeMoE
§3.3.2's offline profile: P(expert at layer n | experts at layers n-2 and n-1), backing off to
layer n-1 alone, then to the layer's marginal; it predicts what to preload and gives EdgeMoE its
frequencies. `simulate` replays a recorded routing trace through a buffer of a given capacity and
counts hits, misses, preloads and bytes read, so policies can be compared on the same trace.

Both policies rank the running layer's experts last, so a caller that takes victims from the front
never takes one of them while anything else is held.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Sequence

from common.errors import CadenceError

PATHS_FILE = "expert_paths.json"  # a store's path statistics, beside it (launch models profile-experts)

Key = tuple[int, int]
_FORMAT = "cadence.expert-paths"
_VERSION = 1


class LRU:
    """Least recently used first (an expert never used comes before all used ones, by key)."""

    def __init__(self):
        self._last: dict[Key, int] = {}
        self._tick = 0

    def use(self, key: Key) -> None:
        self._tick += 1
        self._last[key] = self._tick

    def order(self, cached: Iterable[Key], layer: int) -> list[Key]:
        last = self._last
        return sorted(cached, key=lambda k: (k[0] == layer, last.get(k, 0), k))


class EdgeMoEEviction:
    """EdgeMoE §3.3.3: score from activation frequency and layer distance.

    The paper (its text as extracted, the fraction or product sign lost): "For the j-th expert at
    i-th MoE layer, we define its eviction score as L_{i,j}: L_{i,j} = f_{i,j} (S-i+I) mod S, where
    I is the index of current MoE layer, f_{i,j} is the frequency of the j-th expert activated in
    the i-th MoE layer, and S indicates the size of MoE layers". Its key idea: "give priority to the
    eviction of experts ... with lower usage frequency and those whose layers are farther away from
    the current block"; "if an expert resides in a layer that is going to be executed soon, it shall
    be endowed with higher score for not being evicted".

    Implemented: score(i, j) = f_{i,j} * ((S - i + I) mod S), and the LOWEST score is evicted first.
    (S - i + I) mod S = (I - i) mod S counts the layers since layer i last ran: S-1 for layer I+1
    (the next to run), 1 for layer I-1 (just ran, runs again furthest in the future; decoding cycles
    through layers 0..S-1 per token), 0 for the running layer I itself. So the product is large for
    frequent experts of layers coming soon, which is what the paper says to keep. The reading
    f / ((S-i+I) mod S) with "the higher L, the sooner evicted" would evict the most frequent
    experts first and divide by zero at i = I, against the stated key idea, so it is not used.
    Ties (e.g. never-seen experts, f = 0) go to the farther layer first, then the less frequent,
    then the least recently used. The running layer's experts (score 0 in the formula, though in use)
    come last, by frequency then recency. The paper's f = 0 for encoder experts does not apply
    (decoder only).

    f comes from a profiled prior (`PathStats.frequency()`), else from the uses counted online
    (counts / all uses: the scale does not change the order).
    """

    def __init__(self, n_layers: int, n_experts: int, freq: dict[Key, float] | None = None):
        if n_layers < 1 or n_experts < 1:
            raise ValueError(f"EdgeMoE eviction needs at least one layer and one expert, not {n_layers} x {n_experts}.")
        self.n_layers = n_layers
        self.n_experts = n_experts
        self._prior = dict(freq) if freq is not None else None
        self._count: Counter = Counter()
        self._total = 0
        self._last: dict[Key, int] = {}
        self._tick = 0

    def use(self, key: Key) -> None:
        self._tick += 1
        self._last[key] = self._tick
        if self._prior is None:
            self._count[key] += 1
            self._total += 1

    def frequency(self, key: Key) -> float:
        if self._prior is not None:
            return self._prior.get(key, 0.0)
        return self._count[key] / self._total if self._total else 0.0

    def score(self, key: Key, layer: int) -> float:
        """f * ((S - i + I) mod S): the higher, the longer the expert is kept."""
        S = self.n_layers
        return self.frequency(key) * ((S - key[0] + layer) % S)

    def order(self, cached: Iterable[Key], layer: int) -> list[Key]:
        S, last = self.n_layers, self._last

        def rank(k: Key):
            f = self.frequency(k)
            if k[0] == layer:
                return (1, 0.0, 0, f, last.get(k, 0), k)
            since = (S - k[0] + layer) % S  # 1 = runs again furthest ahead, S-1 = runs next
            return (0, f * since, since, f, last.get(k, 0), k)

        return sorted(cached, key=rank)


def make_eviction(name: str, n_layers: int, n_experts: int, profile: "PathStats | None" = None):
    """ "lru" or "edgemoe" (with the profile's frequencies when given, else counted online)."""
    if name == "lru":
        return LRU()
    if name == "edgemoe":
        if profile is not None and (profile.n_layers, profile.n_experts) != (n_layers, n_experts):
            raise ValueError(
                f"The expert path profile is for {profile.n_layers} layers x {profile.n_experts} experts, "
                f"not this model's {n_layers} x {n_experts}; re-profile this model."
            )
        return EdgeMoEEviction(n_layers, n_experts, profile.frequency() if profile is not None else None)
    raise ValueError(f"Unknown expert eviction policy {name!r}: choose 'lru' or 'edgemoe'.")


def _ids(xs: Sequence[int] | None) -> tuple[int, ...]:
    return tuple(sorted(set(xs))) if xs else ()


def _fmt(ids: tuple[int, ...]) -> str:
    return ",".join(map(str, ids))


def _parse(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split(",")) if s else ()


class PathStats:
    """EdgeMoE §3.3.2: P(expert e at layer n | experts at layers n-2 and n-1), profiled offline.

    Counts are kept per (layer, experts of layer n-2, experts of layer n-1) as sets (the router's
    order among its top-k does not matter); layer 1 has no n-2 (empty set), layer 0 neither (both
    empty). The layer-(n-1)-only table and the marginals are sums of that one table, rebuilt on load.
    A probability is the fraction of the tokens with that key that used e (top-k: they sum to k).
    """

    def __init__(self, n_layers: int, n_experts: int):
        if n_layers < 1 or n_experts < 1:
            raise ValueError(f"A path profile needs at least one layer and one expert, not {n_layers} x {n_experts}.")
        self.n_layers = n_layers
        self.n_experts = n_experts
        # per layer: key -> [tokens seen with it, Counter of experts used at the layer]
        self._pair: list[dict[tuple, list]] = [{} for _ in range(n_layers)]
        self._one: list[dict[tuple, list]] = [{} for _ in range(n_layers)]
        self._marg: list[list] = [[0, Counter()] for _ in range(n_layers)]

    def _count(self, layer: int, p2: tuple, p1: tuple, tokens: int, counts: Iterable[tuple[int, int]]):
        for table, key in ((self._pair[layer], (p2, p1)), (self._one[layer], p1), (None, None)):
            slot = table.setdefault(key, [0, Counter()]) if table is not None else self._marg[layer]
            slot[0] += tokens
            for e, c in counts:
                slot[1][e] += c

    def add(self, path: Sequence[Sequence[int]]) -> None:
        """One token's routing: path[layer] = the expert ids it used at that layer."""
        if len(path) != self.n_layers:
            raise ValueError(f"A token's path has {len(path)} layers; this profile has {self.n_layers}.")
        sets = [_ids(p) for p in path]
        for layer, used in enumerate(sets):
            if used and not (0 <= used[0] and used[-1] < self.n_experts):
                raise ValueError(f"Layer {layer} uses experts {list(used)}; ids must lie in 0..{self.n_experts - 1}.")
            p1 = sets[layer - 1] if layer >= 1 else ()
            p2 = sets[layer - 2] if layer >= 2 else ()
            self._count(layer, p2, p1, 1, [(e, 1) for e in used])

    @staticmethod
    def _best(slot, k: int, skip: set) -> list[tuple[int, float]]:
        n, c = slot
        ranked = sorted(((-cnt, e) for e, cnt in c.items() if cnt > 0 and e not in skip))
        return [(e, -neg / n) for neg, e in ranked[:k]]

    def predict(self, layer: int, prev1: Sequence[int], prev2: Sequence[int] | None, k: int) -> list[tuple[int, float]]:
        """The k most likely experts at `layer`, best first, with their estimated probability.

        From the (prev2, prev1) key when profiled, else P(e | prev1) when that was, else the layer's
        marginal (layer 0 always; layer 1 and a None prev2 start at prev1). When the first level found
        names fewer than k experts the rest come from the next levels, without repeats. Ties: lower
        expert id first. An expert never seen at the layer is never named (fewer than k then).
        """
        if not 0 <= layer < self.n_layers:
            raise ValueError(f"Layer {layer} is outside this profile's 0..{self.n_layers - 1}.")
        if k <= 0:
            return []
        p1, levels = _ids(prev1), []
        if layer >= 2 and prev2 is not None:
            levels.append(self._pair[layer].get((_ids(prev2), p1)))
        if layer >= 1:
            levels.append(self._one[layer].get(p1))
        levels.append(self._marg[layer])
        out: list[tuple[int, float]] = []
        for slot in levels:
            if slot is None or slot[0] == 0:
                continue
            out += self._best(slot, k - len(out), {e for e, _ in out})
            if len(out) >= k:
                break
        return out

    def frequency(self) -> dict[Key, float]:
        """Per (layer, expert): the fraction of profiled tokens that used it."""
        return {(layer, e): c / n for layer, (n, cnt) in enumerate(self._marg) for e, c in cnt.items() if n}

    def to_json(self) -> dict:
        """{"l|a,b|x,y": [tokens, e, count, e, count, ...]}: the (n-2, n-1) table, all the rest follows."""
        counts = {}
        for layer, table in enumerate(self._pair):
            for (p2, p1), (n, c) in sorted(table.items()):
                counts[f"{layer}|{_fmt(p2)}|{_fmt(p1)}"] = [n] + [v for e in sorted(c) for v in (e, c[e])]
        return {
            "format": _FORMAT,
            "version": _VERSION,
            "n_layers": self.n_layers,
            "n_experts": self.n_experts,
            "counts": counts,
        }

    @classmethod
    def from_json(cls, d: dict) -> "PathStats":
        if not isinstance(d, dict) or d.get("format") != _FORMAT or d.get("version") != _VERSION:
            raise ValueError(f"not a {_FORMAT} v{_VERSION} profile")
        stats = cls(int(d["n_layers"]), int(d["n_experts"]))
        for key, row in d["counts"].items():
            layer_s, p2_s, p1_s = key.split("|")
            layer, n, rest = int(layer_s), int(row[0]), [int(x) for x in row[1:]]
            if not 0 <= layer < stats.n_layers or len(rest) % 2 or n <= 0:
                raise ValueError(f"bad entry {key!r}")
            pairs = list(zip(rest[::2], rest[1::2]))
            if any(not 0 <= e < stats.n_experts for e, _ in pairs):
                raise ValueError(f"bad expert id in {key!r}")
            stats._count(layer, _parse(p2_s), _parse(p1_s), n, pairs)
        return stats

    def save(self, path) -> None:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.to_json(), f, separators=(",", ":"))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path) -> "PathStats":
        try:
            with open(path) as f:
                return cls.from_json(json.load(f))
        except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError) as e:
            reason = "it is missing" if isinstance(e, FileNotFoundError) else f"it is damaged: {e}"
            raise CadenceError(
                f"The expert path profile {path} cannot be read ({reason}); re-profile the model to write it again."
            ) from None


@dataclass
class SimResult:
    hits: int = 0
    misses: int = 0
    preloaded: int = 0
    preload_hits: int = 0
    bytes_read: int = 0

    @property
    def hit_rate(self) -> float:
        used = self.hits + self.misses
        return self.hits / used if used else 0.0


def simulate(
    trace: Sequence[Sequence[Sequence[int]]],
    capacity: int,
    eviction,
    *,
    preload: "PathStats | None" = None,
    preload_k: int = 0,
    lookahead: Sequence[Sequence[Sequence[int]]] | None = None,
    expert_bytes: int = 1,
) -> SimResult:
    """Replay a trace (trace[token][layer] = the expert ids used) through a buffer of `capacity` experts.

    A used expert not in the buffer is a miss (read, then admitted, evicting by `eviction.order`),
    never evicting an expert the layer being computed uses; other experts of that layer (wrong
    preloads) go only when nothing else is held. Before each layer, `preload` (PathStats) predicts
    `preload_k` experts from the two previous layers' real experts, or `lookahead[token][layer]`
    gives the layer's predicted experts directly (the next-router guess); those not held are read
    and admitted (`preloaded`; a later hit on one, before it is evicted, counts in `preload_hits`).
    A preload never evicts an expert of the current layer: with no other victim it is skipped.
    Every read (miss or preload) adds expert_bytes to bytes_read. `eviction.use` hears each used
    expert in order of use (hit or miss), never a preload.

    A capacity below the most experts one layer uses is a ValueError: that layer could not run.
    """
    if preload is not None and lookahead is not None:
        raise ValueError("Give simulate either a preload profile or a lookahead, not both.")
    if lookahead is not None and len(lookahead) != len(trace):
        raise ValueError(f"The lookahead has {len(lookahead)} tokens; the trace has {len(trace)}.")
    top = max((len(set(experts)) for tok in trace for experts in tok), default=0)
    if capacity < max(top, 1):
        raise ValueError(
            f"A buffer of {capacity} experts cannot hold the {top} experts one layer uses at once; "
            f"give it at least {max(top, 1)}."
        )
    replay = _Replay(capacity, eviction, expert_bytes)
    for t, token in enumerate(trace):
        for layer, experts in enumerate(token):
            if preload is not None and preload_k > 0:
                prev1 = token[layer - 1] if layer >= 1 else ()
                prev2 = token[layer - 2] if layer >= 2 else None
                replay.preload(layer, [e for e, _ in preload.predict(layer, prev1, prev2, preload_k)])
            elif lookahead is not None:
                replay.preload(layer, list(dict.fromkeys(lookahead[t][layer])))
            replay.use(layer, list(dict.fromkeys(experts)))
    return replay.res


class _Replay:
    """The buffer `simulate` replays a trace through."""

    def __init__(self, capacity: int, eviction, expert_bytes: int):
        self.capacity, self.eviction, self.expert_bytes = capacity, eviction, expert_bytes
        self.res = SimResult()
        self.held: set[Key] = set()
        self.pending: set[Key] = set()  # preloaded, not used since

    def victim(self, layer: int, spare: set[Key] | None) -> Key | None:
        rest = None
        for k in self.eviction.order(self.held, layer):
            if k[0] != layer:
                return k
            if rest is None and spare is not None and k not in spare:
                rest = k
        return rest

    def admit(self, key: Key, layer: int, spare: set[Key] | None) -> bool:
        if len(self.held) >= self.capacity:
            v = self.victim(layer, spare)
            if v is None:
                return False
            self.held.discard(v)
            self.pending.discard(v)
        self.held.add(key)
        self.res.bytes_read += self.expert_bytes
        return True

    def preload(self, layer: int, guess: list[int]) -> None:
        for e in guess:
            key = (layer, e)
            if key not in self.held and self.admit(key, layer, None):
                self.res.preloaded += 1
                self.pending.add(key)

    def use(self, layer: int, used: list[int]) -> None:
        needed = {(layer, e) for e in used}
        for e in used:
            key = (layer, e)
            if key in self.held:
                self.res.hits += 1
                if key in self.pending:
                    self.res.preload_hits += 1
                    self.pending.discard(key)
            else:
                self.res.misses += 1
                admitted = self.admit(key, layer, needed)
                assert admitted, "capacity >= the layer's experts leaves a victim"
            self.eviction.use(key)
