"""Is speculating paying off? Choose each cycle's draft budget from measured throughput.

On a 2-core CPU a wide verification is not free (each extra row costs a share of a decode step)
and the draft model costs a third of the target, so a tree that is rarely accepted is slower
than the target alone. The governor keeps, per arm (a plain target step, prompt lookup, a draft tree
of a given size: common/settings.py `Arm`), a moving
average of tokens per second actually obtained, plays the best one, and now and then tries a
neighbour so the estimates follow the text (code that is being copied, prose that is not).
A try that loses doubles the wait before the next one (up to `max_gap` cycles): where
speculation does not pay, probing it must not cost much either; a try that wins resets it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.settings import PLAIN, Arm


@dataclass
class Governor:
    arms: tuple[Arm, ...]  # the choices, in order (common/settings.py `arms`)
    start: Arm  # the arm to begin with
    explore_every: int = 6  # cycles between tries of a neighbouring budget, at first
    max_gap: int = 48  # ... and at most, after tries that lost
    decay: float = 0.7  # weight of the past in the moving averages
    rate: dict[Arm, float] = field(default_factory=dict)  # arm -> tokens per second
    cycles: int = 0
    current: Arm = PLAIN
    gap: int = 0  # cycles between tries now
    last_try: int = 0  # the cycle of the last try
    trying: Arm | None = None  # the arm being tried this cycle

    def __post_init__(self):
        if PLAIN not in self.arms:
            self.arms = tuple(sorted((PLAIN, *self.arms)))
        self.current = self.start if self.start in self.arms else self.arms[-1]
        self.gap = self.explore_every

    def new_text(self):
        """A new prompt: keep what each budget earned, but probe again soon (the new text may be code
        being copied where the last was prose), instead of after a back-off the last text ran up."""
        self.gap, self.last_try, self.trying = self.explore_every, self.cycles, None

    def choose(self) -> Arm:
        """The arm for the next cycle."""
        self.cycles += 1
        known = dict(self.rate)
        if PLAIN not in known and self.cycles > 1:
            return PLAIN  # measure the plain step once, early: the bar speculation has to clear
        if not known:
            return self.current
        best = max(known, key=known.get)
        if self.cycles - self.last_try >= self.gap:
            i = self.arms.index(best)
            untried = [a for a in self.arms[max(0, i - 1) : i + 2] if a != best]
            if untried:
                # try the neighbour we know least about (never tried, or the less recent guess)
                self.last_try = self.cycles
                self.trying = min(untried, key=lambda a: known.get(a, -1.0))
                return self.trying
        return best

    def record(self, arm: Arm, tokens: int, seconds: float):
        if seconds <= 0 or arm not in self.arms:
            return  # a draft cut short by the end of the generation says nothing about its size
        r = tokens / seconds
        old = self.rate.get(arm)
        self.rate[arm] = r if old is None else self.decay * old + (1 - self.decay) * r
        if self.trying is not None and arm == self.trying:
            self.trying = None
            # this try beat the best average: look again soon (the averages need a few tries to turn)
            won = r > max((v for a, v in self.rate.items() if a != arm), default=0.0)
            self.gap = self.explore_every if won else min(2 * self.gap, self.max_gap)
