"""What speculation measurably gives on this machine's runs: the tokens a tree verification wrote with a draft
model (its accepted tokens and the target's own), and with the n-gram trie alone, per target forward. Kept under
$CADENCE_HOME/calibration/accept-<key>.json for the pair (the target's store, the draft's store and the rows its
head keeps: an int2 draft or a cut head is another pair), added to by every tree run that uses it, the older
verifications weighing less as newer ones come (KEEP).

`--draft auto` under a budget prices the draft with it (engine/costs.py `draft_pays`): a figure this machine
measured over MIN_VERIFICATIONS or more, in place of the rule of thumb (TOKENS_PER_VERIFICATION) that a weak draft
(BENCHMARKS.md: the int2 draft accepts a third of what int4 does) or a repetitive workload contradicts.
`CADENCE_LEARN=0` in the environment: plans from the rule of thumb, and nothing kept (plans that do not depend on
the runs before them: the test suite's, a benchmark's)."""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass

from common import paths
from common.calibration import keep

TOKENS_PER_VERIFICATION = 2.5  # what a draft of the same family gives, at the least, on varied text (BENCHMARKS.md)
MIN_VERIFICATIONS = 64  # a record speaks for a pair from this many verifications on
KEEP = 4096  # target forwards' worth a record holds: past it, the older weigh less (the workload changes)
FLUSH = 512  # a long run (a server's) adds its figures every this many target forwards, and as it closes


@dataclass(frozen=True)
class Acceptance:
    verifications: float = 0.0
    accepted: float = 0.0  # draft tokens the target confirmed in them
    forwards: float = 0.0  # target forwards while generating (verifications and plain steps)
    tokens: float = 0.0  # tokens written meanwhile
    runs: int = 0
    updated: str = ""

    @property
    def speaks(self) -> bool:
        return self.verifications >= MIN_VERIFICATIONS

    def per_verification(self) -> float:
        """Tokens a verification writes: the accepted draft tokens and the target's own next one."""
        return 1 + self.accepted / max(self.verifications, 1)

    def per_forward(self) -> float:
        """Tokens a target forward writes, plain steps counted."""
        return self.tokens / max(self.forwards, 1)

    def describe(self, what: str, forward: bool = False) -> str:
        """`what` gives so many tokens a verification (`forward`: a forward), measured over how many, when."""
        n, figure = (
            (f"{self.forwards:.0f} forwards", f"{self.per_forward():.2f} tokens a forward")
            if forward
            else (f"{self.verifications:.0f} verifications", f"{self.per_verification():.2f} tokens a verification")
        )
        return f"{what} {figure}, measured over {n} of {self.runs} run{'' if self.runs == 1 else 's'} here (last {self.updated})"

    def plus(self, other: "Acceptance", runs: int = 0, updated: str = "") -> "Acceptance":
        """Both together, scaled down to KEEP forwards' worth where they hold more (the older weigh less)."""
        s = min(1.0, KEEP / max(self.forwards + other.forwards, 1))
        return Acceptance(
            (self.verifications + other.verifications) * s,
            (self.accepted + other.accepted) * s,
            (self.forwards + other.forwards) * s,
            (self.tokens + other.tokens) * s,
            self.runs + runs,
            updated or self.updated,
        )

    def add(self, stats: dict, new_tokens: int) -> "Acceptance":
        """This record with a generation's `stats` (common/settings.py SpecStats.as_dict) added."""
        v = stats.get("verifications", 0)
        forwards = v + stats.get("plain_steps", 0)
        return self.plus(Acceptance(v, stats.get("accepted", 0), forwards, new_tokens)) if forwards else self


def learning() -> bool:
    return os.environ.get("CADENCE_LEARN", "1") != "0"


def key(target_dir, draft_dir, head_rows: int) -> str:
    """The pair: the target's store, the draft's (None: the trie alone) and the token rows its head keeps."""
    return hashlib.sha256(f"{target_dir} {draft_dir or ''} {head_rows}".encode()).hexdigest()[:16]


def expected(target_dir, draft_dir, head_rows: int) -> tuple[float, float, str]:
    """(tokens a verification writes with the draft, tokens a forward writes with the trie alone, the line a plan
    says of them): as measured here where enough was, else TOKENS_PER_VERIFICATION and one."""
    got, alone = read(key(target_dir, draft_dir, head_rows)), read(key(target_dir, None, 0))
    lines = [
        got.describe("the draft")
        if got.speaks
        else f"the draft {TOKENS_PER_VERIFICATION} tokens a verification (assumed: too few measured here yet)"
    ]
    lines += [alone.describe("the trie alone", forward=True)] if alone.forwards >= MIN_VERIFICATIONS else []
    return (
        got.per_verification() if got.speaks else TOKENS_PER_VERIFICATION,
        alone.per_forward() if alone.forwards >= MIN_VERIFICATIONS else 1.0,
        "acceptance: " + "; ".join(lines),
    )


def of_plan(plan) -> str:
    """The key of a run's pair (engine/plan.py RunPlan)."""
    d = plan.draft
    return key(plan.target.dir, d.store.dir if d.model else None, d.head_rows)


def _path(k: str):
    return paths.home() / "calibration" / f"accept-{k}.json"


def read(k: str) -> Acceptance:
    """The pair's record (empty where none was kept or it cannot be read, or CADENCE_LEARN=0)."""
    if not learning():
        return Acceptance()
    try:
        got = Acceptance(**json.loads(_path(k).read_text()))
        got.per_verification() + got.per_forward() + got.runs  # figures, not text
        return got
    except (OSError, ValueError, TypeError):
        return Acceptance()


def record(k: str, measured: Acceptance) -> Acceptance:
    """A run's figures (a server's since the last) for the pair added to what is kept, and kept (a home that cannot be written keeps nothing)."""
    if not (measured.forwards and learning()):
        return read(k)
    out = read(k).plus(measured, runs=1, updated=time.strftime("%Y-%m-%d %H:%M"))
    try:
        keep(_path(k), asdict(out))
    except OSError:
        pass
    return out
