"""Is speculating paying off? Choose each cycle's draft budget from measured throughput.

On a 2-core CPU a wide verification is not free (each extra row costs a share of a decode step)
and the draft model costs a third of the target, so a tree that is rarely accepted is slower
than the target alone. The governor keeps, per draft budget (0 = a plain target step), a moving
average of tokens per second actually obtained, plays the best one, and now and then tries a
neighbour so the estimates follow the text (code that is being copied, prose that is not).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Governor:
    widths: tuple[int, ...]  # candidate draft budgets, ascending; 0 means "no speculation"
    start: int  # the budget to begin with
    explore_every: int = 6  # cycles between tries of a neighbouring budget
    decay: float = 0.7  # weight of the past in the moving averages
    rate: dict[int, float] = field(default_factory=dict)  # budget -> tokens per second
    cycles: int = 0
    current: int = -1

    def __post_init__(self):
        if 0 not in self.widths:
            self.widths = (0, *self.widths)
        self.current = self.start if self.start in self.widths else self.widths[-1]

    def choose(self) -> int:
        """The draft budget for the next cycle."""
        self.cycles += 1
        known = {w: r for w, r in self.rate.items()}
        if 0 not in known and self.cycles > 1:
            return 0  # measure the plain step once, early: the bar speculation has to clear
        if not known:
            return self.current
        best = max(known, key=known.get)
        if self.cycles % self.explore_every == 0:
            i = self.widths.index(best)
            untried = [w for w in self.widths[max(0, i - 1):i + 2] if w != best]
            if untried:
                # try the neighbour we know least about (never tried, or the less recent guess)
                return min(untried, key=lambda w: known.get(w, -1.0))
        return best

    def record(self, width: int, tokens: int, seconds: float):
        if seconds <= 0 or width not in self.widths:
            return  # a budget cut short by the end of the generation says nothing about its width
        r = tokens / seconds
        old = self.rate.get(width)
        self.rate[width] = r if old is None else self.decay * old + (1 - self.decay) * r
