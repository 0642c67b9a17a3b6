"""Is speculating paying off, and how far? Choose each cycle's draft budget from measured throughput.

On a 2-core CPU a wide verification is not free (each extra row costs a share of a decode step)
and a draft forward costs a third of a target step, so a tree that is rarely accepted is slower than
the target alone, and one cut too short leaves tokens the draft would have got right.

The plain step and prompt lookup are judged by the tokens per second they measurably earned (a moving
average per arm). The draft budgets share one model, ARCA's formula (speculative/arca.py) fed online
instead of by a profile: each verification tells how often a draft token at a given depth is accepted
(`p`, recent verifications weigh most), and each cycle what a draft forward costs and what a
verification of so many rows costs. A budget of n is then worth 1 + (what its draft tokens are expected
to accept) tokens in (its draft forwards x a forward's cost + the verification of its rows), so one
measured cycle informs every budget and the best one is played at once, not found a step at a time.
What a budget's tokens are expected to accept: the summed cumulative draft probability of the best n
nodes of the trees drafted (each tree reports its nodes' worths: one tree of 32 prices every budget up
to 32), scaled by how often the draft's beliefs held; before any, a chain's 1 + p + ... + p^d, d its
trees' depth. (A chain's formula sees no gain in width past the trees' depth: under a budget, where the
disk sets a verification's time whatever its rows, it played narrow trees that accept less.)

Now and then the governor tries what it is not playing (a draft budget while the plain step or lookup
leads, since only drafting measures `p`; else the plain step or lookup): a try that loses doubles the
wait before the next one (up to `max_gap` cycles), a try that wins resets it. A resident batch's governor also
asks, before a try of drafting, whether its price (the drafts' catch-up on the text they have not read) is a
small enough share of the time since the last (`CatchUp`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterable

from common.settings import CATCH_UP, LOOKUP, PLAIN, Arm, TreeConfig
from speculative.arca import interpolate
from speculative.sides import Start, Verify

PRIOR_HITS, PRIOR_TRIES = 4.0, 5.0  # p = 0.8 before any verification (a draft of the target's family),
# worth five draft tokens of evidence: one early miss must not talk the governor out of drafting
FORGET = 0.95  # per draft token tried: the weight the acceptance counts keep (the text changes under the draft)
SPIKE = 1.5  # a cost sample counts for at most this much above its average (a noisy host's stalls)


@dataclass(frozen=True)
class Cycle:
    """What a draft cycle measured: its draft and verification seconds, the draft forwards it ran, the rows
    verified (the root with the tree), the tree's depth and the accepted path's length."""

    draft_s: float
    verify_s: float
    forwards: int
    rows: int
    depth: int
    accepted: int
    worth: tuple = ()  # the tree's nodes' cumulative draft probabilities, greatest first


def _ema(old: float | None, new: float, keep: float) -> float:
    """The moving average; a sample far above it (a stall on a shared host) moves it as SPIKE times it would:
    one slow cycle must not price drafting out for the many cycles until it is tried again."""
    return new if old is None else keep * old + (1 - keep) * min(new, SPIKE * old)


@dataclass
class CostModel:
    """The draft's acceptance and the cycle's costs, measured: what a budget is expected to earn."""

    hits: float = PRIOR_HITS
    tries: float = PRIOR_TRIES
    forward_s: float | None = None  # one draft forward
    plain_s: float | None = None  # a plain target step
    verify_s: dict[int, float] = field(default_factory=dict)  # rows -> one verification
    shape: dict[Arm, tuple[float, float, float]] = field(default_factory=dict)  # arm -> forwards, rows, depth
    worth_priced: bool = False  # a budget's tokens from the trees' worths (best-first trees), else the chain's
    worth: dict[int, float] = field(default_factory=dict)  # k -> the worth of a tree's k-th best node (moving
    # averages, each rank its own: a narrow tree leaves the wider ranks as the last wide one measured them)
    accepted: float = PRIOR_HITS  # draft tokens the verifications accepted ...
    predicted: float = PRIOR_TRIES  # ... and the summed worth of the trees verified: sums that fade as `hits` and
    # `tries` do, from the same prior (one tree that missed must not price every budget at nothing)
    keep: float = 0.7

    @property
    def p(self) -> float:
        return self.hits / self.tries

    def record(self, arm: Arm, c: Cycle) -> None:
        # depths 1..accepted were right; the next one was tried and wrong unless the tree ended there
        tried = c.accepted + (c.accepted < c.depth)
        fade = FORGET**tried
        self.hits = fade * self.hits + c.accepted
        self.tries = fade * self.tries + tried
        if c.forwards:
            self.forward_s = _ema(self.forward_s, c.draft_s / c.forwards, self.keep)
        self.verify_s[c.rows] = _ema(self.verify_s.get(c.rows), c.verify_s, self.keep)
        old = self.shape.get(arm)
        new = (c.forwards, c.rows, c.depth)
        self.shape[arm] = new if old is None else tuple(self.keep * a + (1 - self.keep) * b for a, b in zip(old, new))
        if c.worth and all(map(math.isfinite, c.worth)):  # one tree tells what each smaller budget's nodes are worth
            for k, w in enumerate(c.worth, 1):  # (plain averages: a worth that rises is news, not a stall)
                old = self.worth.get(k)
                self.worth[k] = w if old is None else self.keep * old + (1 - self.keep) * w
            self.accepted = fade * self.accepted + c.accepted
            self.predicted = fade * self.predicted + sum(c.worth)

    def expected(self, size: int, depth: float) -> float:
        """Draft tokens a verification of a tree of `size` nodes and `depth` accepts: the summed worth of the best
        `size` nodes of the trees drafted (a node is accepted about as often as the draft believes its whole path,
        scaled by how the draft's beliefs fared), where trees that large were seen; else a chain's, from the
        acceptance per depth."""
        if self.worth_priced and self.worth:  # self.worth holds k = 1 .. the largest tree seen
            best = sum(self.worth[k] for k in range(1, min(size, len(self.worth)) + 1))
            return min(size, best * self.accepted / max(self.predicted, 1e-9))
        return sum(self.p**i for i in range(1, max(1, round(depth)) + 1))

    def verification(self, rows: float) -> float | None:
        """Seconds to verify `rows` rows: measured, else interpolated between measured widths (a plain step is
        one row; past the widest, the last slope)."""
        pts = dict(self.verify_s)
        if self.plain_s is not None:
            pts.setdefault(1, self.plain_s)
        return interpolate(pts, rows) if pts else None

    def rate(self, arm: Arm) -> float | None:
        """Expected tokens per second of a draft budget, or None before a draft forward was measured."""
        if self.forward_s is None:
            return None
        forwards, rows, depth = self.shape.get(arm, (arm.size, arm.size + 1, arm.size))
        v = self.verification(rows)
        if v is None:
            return None
        return (1.0 + self.expected(arm.size, depth)) / (forwards * self.forward_s + v)


@dataclass
class Governor:
    arms: tuple[Arm, ...]  # the choices, in order (common/settings.py `arms`)
    start: Arm  # the arm to begin with
    explore_every: int = 6  # cycles between tries of what is not being played, at first
    max_gap: int = 48  # ... and at most, after tries that lost
    decay: float = 0.7  # weight of the past in the moving averages
    rate: dict[Arm, float] = field(default_factory=dict)  # arm -> tokens per second measured
    model: CostModel = field(default_factory=CostModel)
    cycles: int = 0
    current: Arm = PLAIN
    gap: int = 0  # cycles between tries now
    last_try: int = 0  # the cycle of the last try
    trying: Arm | None = None  # the arm being tried this cycle
    plain: bool = True  # the plain step is an arm (a batch under the wall: a read for a token each never is)
    try_share: float | None = None  # where set, a losing try waits until what it lost is at most this share of the
    # time since (a try that costs many cycles' worth, as drafting after plain steps does in a resident batch)
    cycle_s: float | None = None  # the moving average of a cycle's seconds, tries aside
    may_try: Callable[[], bool] | None = None  # where set, whether a try of drafting is made now (a resident batch
    # prices its drafts' catch-up before it tries: `CatchUp`)

    def __post_init__(self):
        if PLAIN not in self.arms and self.plain:
            self.arms = tuple(sorted((PLAIN, *self.arms)))
        self.current = self.start if self.start in self.arms else self.arms[-1]
        self.gap = self.explore_every
        self.model.keep = self.decay

    def new_text(self):
        """A new prompt: keep what each budget earned, but probe again soon (the new text may be code
        being copied where the last was prose), instead of after a back-off the last text ran up."""
        self.gap, self.last_try, self.trying = self.explore_every, self.cycles, None

    def estimate(self, arm: Arm) -> float | None:
        """Tokens per second expected of `arm`: the model's for a draft budget, else what it measured."""
        if arm.kind == "draft":
            r = self.model.rate(arm)
            return r if r is not None else self.rate.get(arm)
        return self.rate.get(arm)

    def choose(self) -> Arm:
        """The arm for the next cycle."""
        self.cycles += 1
        known = {a: r for a in self.arms if (r := self.estimate(a)) is not None and math.isfinite(r)}
        if self.plain and PLAIN not in self.rate and self.cycles > 1:
            return PLAIN  # measure the plain step once, early: the bar speculation has to clear
        if not known:
            return self.current
        best = max(known, key=known.get)
        if self.cycles - self.last_try >= self.gap:
            drafts = [a for a in known if a.kind == "draft"]
            if best.kind == "draft":  # refresh what drafting competes with, the least recently judged first
                others = [a for a in (LOOKUP, PLAIN) if a in self.arms]
                if not others and self.model.rate(best) is None:  # budgets judged apart (a streamed batch's)
                    others = [a for a in self.arms if a != best]  # (the model prices every budget from one)
            else:  # only drafting measures the draft's acceptance
                others = [max(drafts, key=known.get)] if drafts else [a for a in self.arms if a.kind == "draft"][:1]
            others = [a for a in others if a != best]
            if others and best.kind != "draft" and self.may_try is not None and not self.may_try():
                others = []  # a try of drafting would cost more than its share now
            if others:
                self.last_try = self.cycles
                self.trying = min(others, key=lambda a: self.rate.get(a, -1.0))
                return self.trying
        return best

    def record(self, arm: Arm, tokens: int, seconds: float, cycle: Cycle | None = None, catchup_s: float = 0.0):
        """A cycle of `arm` made `tokens` in `seconds`; `cycle`: what a draft cycle measured; `catchup_s`: of the
        seconds, the drafts' catch-up on text they missed while plain steps ran (a batch's try of drafting pays
        it once, then drafts on): left out of the arm's rate, counted in what a lost try cost."""
        if seconds <= 0:
            return
        if cycle is not None and arm.kind == "draft" and cycle.depth:
            self.model.record(arm, cycle)
        if arm == PLAIN:
            self.model.plain_s = _ema(self.model.plain_s, seconds / max(tokens, 1), self.decay)
        if arm not in self.arms:
            return  # a draft cut short by the end of the generation: no arm of its own
        before = {a: r for a in self.arms if a != arm and (r := self.estimate(a)) is not None}
        r = tokens / max(seconds - catchup_s, seconds / 100)
        old = self.rate.get(arm)
        self.rate[arm] = r if old is None else self.decay * old + (1 - self.decay) * r
        if self.trying is None or arm != self.trying:
            self.cycle_s = _ema(self.cycle_s, seconds, self.decay)
            return
        self.trying = None
        # this try beat the best of the rest: look again soon (the averages need a few tries to turn)
        best = max(before.values(), default=0.0)
        won = r > best
        self.gap = self.explore_every if won else min(2 * self.gap, self.max_gap)
        if not won and self.try_share and self.cycle_s and best > 0:
            lost_s = seconds - tokens / best  # what the try cost over the best arm's time for its tokens
            self.gap = max(self.gap, math.ceil(lost_s / (self.try_share * self.cycle_s)))


TRY_SHARE = 0.03  # a resident batch's tries of drafting cost at most this share of its time (they lose there
# on a 2-core CPU: several generations' single rows in one forward cost little more than one, and a try pays the
# drafts' catch-up on the text the plain steps made: ~8 plain cycles' worth at four generations, BENCHMARKS.md)


@dataclass
class CatchUp:
    """What a resident batch's next try of drafting would pay before it drafts a token: its drafts' run over the text
    they have not seen (a new generation's prompt, as much of it as the draft reads, then a token for each plain
    step: at most CATCH_UP once it has drafted, speculative/feed.py). At eight generations on two cores that is a
    forward over their prompts, 0.46 s of a 6.9 s run (BENCHMARKS.md), more than a try can win back there. A try is
    made only while that price is at most TRY_SHARE of the seconds the batch ran since its last try. A row is
    priced as the drafts' catch-ups measurably cost, and before any as a prompt row of the target's (a larger
    model's: the price errs high)."""

    row_s: float | None = None  # a row of the drafts' catch-up (moving average)
    prompt_row_s: float | None = None  # a row of the target's forwards over prompts (moving average)
    spent: float = 0.0  # seconds the batch ran since its last try of drafting
    behind: dict = field(default_factory=dict)  # generation -> (tokens its draft has not run on, whether it drafted)
    keep: float = 0.7

    def rows(self, key) -> int:
        """The rows a generation's draft runs over first: what it has not seen, at most CATCH_UP once it drafted."""
        n, drafted = self.behind.get(key, (0, False))
        return min(n, CATCH_UP) if drafted else n

    def price(self, keys: Iterable) -> float | None:
        """Seconds the catch-up of these generations' drafts costs now; None before anything priced a row."""
        row = self.row_s if self.row_s is not None else self.prompt_row_s
        return None if row is None else row * sum(self.rows(k) for k in keys)

    def may_try(self, keys: Iterable) -> bool:
        """Whether a try of drafting is made now (a yes starts the count of seconds to the next)."""
        price = self.price(keys)
        if price is None or price > TRY_SHARE * self.spent:
            return False
        self.spent = 0.0
        return True

    def join(self, key, rows: int, active: Iterable) -> None:
        """A generation whose draft reads `rows` of its prompt (and its first token) first; `active`: who runs."""
        keep = set(active)
        self.behind = {k: v for k, v in self.behind.items() if k in keep}
        self.behind[key] = (rows, False)

    def drafted(self, trees: list[tuple[object, float]]) -> float:
        """Trees grown for these generations (key, the tree's catch-up seconds): their seconds of catch-up, which
        price a row."""
        caught = [(k, s) for k, s in trees if s > 0]
        seconds, rows = sum(s for _, s in caught), sum(self.rows(k) for k, _ in caught)
        if seconds > 0 and rows > 0:
            self.row_s = _ema(self.row_s, seconds / rows, self.keep)
        return seconds

    def answered(self, calls: list[tuple[object, object, int]], seconds: float) -> None:
        """A forward of `seconds` answered these generations' calls (key, its `Start`, `Step` or `Verify`, rows): a
        verification of a drafted tree leaves its draft behind by the target's next token alone, a plain step (or
        the trie's candidates, which the draft did not run on) a token further; prompts price a row."""
        for key, call, _ in calls:
            n, drafted = self.behind.get(key, (0, False))
            if isinstance(call, Verify) and call.proposal.drafted:
                self.behind[key] = (1, True)
            elif not isinstance(call, Start):
                self.behind[key] = (n + 1, drafted)
        if seconds > 0 and any(isinstance(call, Start) for _, call, _ in calls):
            self.prompt_row_s = _ema(self.prompt_row_s, seconds / sum(r for *_, r in calls), self.keep)


def resident_batch_governor(cfg: TreeConfig, may_try: Callable[[], bool] | None = None) -> Governor:
    """A resident batch's governor for a number of generations at once. It begins with plain steps, the bar
    drafting has to clear, and tries drafting now and then, where `may_try()` (`CatchUp.may_try`): after a try
    that lost, not before what it lost is TRY_SHARE of the time since. It waits as long as the governors of the
    other numbers wait (speculative/batch.py `Lockstep.cycle`: what drafting lost at four generations it mostly
    loses at three)."""
    sizes = sorted({2, 4, cfg.budget})
    arms = (PLAIN, *(Arm("draft", n) for n in sizes))
    return Governor(arms, PLAIN, explore_every=12, max_gap=96, try_share=TRY_SHARE, may_try=may_try)
