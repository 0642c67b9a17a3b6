"""What speculation measurably gives on this machine's runs: the tokens a tree verification wrote with a draft
model (its accepted tokens and the target's own), and with the n-gram trie alone, per target forward. Kept under
$CADENCE_HOME/calibration/accept-<key>.json for the pair (the target's store, the draft's store and the rows its
head keeps: an int2 draft or a cut head is another pair), added to by every tree run that uses it, the older
figures weighing less as newer ones come (KEEP forwards' worth).

`--draft auto` under a budget prices the draft with it (engine/costs.py `draft_pays`): a figure this machine
measured over MIN_VERIFICATIONS or more, in place of the rule of thumb (TOKENS_PER_VERIFICATION) that a strong
draft (BENCHMARKS.md: the int4 0.5B draft writes 5 tokens a verification under a budget), a weak one or a
repetitive workload contradicts.
A plan that drops a draft on its record never measures it again, and the workload may change: once the trie alone
has run RETRY forwards since the draft's record last grew, the draft is priced by the rule once more where its
record measured less (said), and the run that keeps it measures it afresh (the old figures dropped).
`CADENCE_LEARN=0` in the environment: plans from the rule of thumb, and nothing kept (plans that do not depend on
the runs before them: the test suite's; `launch bench`'s unless the environment says otherwise)."""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, replace

from common import paths
from common.calibration import keep

TOKENS_PER_VERIFICATION = 2.5  # what a draft of the same family gives, at the least, on varied text (BENCHMARKS.md)
MIN_VERIFICATIONS = 128  # a record speaks for a pair from this many verifications on (a few runs: not one odd one)
KEEP = 4096  # target forwards' worth a record holds: past it, the older weigh less (the workload changes)
FLUSH = 512  # a long run (a server's) adds its figures every this many target forwards, and as it closes
FIELDS = ("verifications", "accepted", "forwards", "tokens", "drafted", "draft_forwards")
RETRY = KEEP  # forwards of the trie alone, since a draft was last measured, after which a plan measures it again


@dataclass(frozen=True)
class Acceptance:
    verifications: float = 0.0
    accepted: float = 0.0  # draft tokens the target confirmed in them (a grammar's forced tokens left out)
    forwards: float = 0.0  # target forwards while generating (verifications and plain steps)
    tokens: float = 0.0  # tokens written meanwhile (forced ones left out)
    drafted: float = 0.0  # tree nodes the verifications checked
    draft_forwards: float = 0.0  # draft forwards that grew them
    runs: int = 0
    updated: str = ""
    total: float = 0.0  # target forwards ever counted (not decayed): the trie alone's is a clock for its drafts
    alone_at: float = 0.0  # a draft's record: the trie alone's `total` when this record last grew

    @property
    def speaks(self) -> bool:
        return self.verifications >= MIN_VERIFICATIONS

    def per_verification(self) -> float:
        """Tokens a verification writes: the accepted draft tokens and the target's own next one."""
        return 1 + max(0.0, self.accepted) / max(self.verifications, 1)

    def per_forward(self) -> float:
        """Tokens a target forward writes, plain steps counted (one at the least)."""
        return max(1.0, self.tokens / max(self.forwards, 1))

    def shape(self) -> tuple[float, float] | None:
        """(rows a verification checked, the root's with its tree's; draft forwards it took), as measured; None
        where no tree was counted."""
        v = max(self.verifications, 1)
        return (1 + self.drafted / v, max(0.0, self.draft_forwards) / v) if self.drafted > 0 else None

    def describe(self, what: str, forward: bool = False) -> str:
        """`what` gives so many tokens a verification (`forward`: a forward), measured over how many, when."""
        if forward:
            n, figure = f"{self.forwards:.0f} forwards", f"{self.per_forward():.2f} tokens a forward"
        else:
            n, figure = (
                f"{self.verifications:.0f} verifications",
                f"{self.per_verification():.2f} tokens a verification",
            )
            if self.shape():
                figure += " of {:.0f} rows after {:.1f} draft forwards".format(*self.shape())
        runs = f"{self.runs} run{'' if self.runs == 1 else 's'}"
        return f"{what} {figure}, measured over {n} of {runs} here (last {self.updated})"

    def plus(self, other: "Acceptance", runs: int = 0, updated: str = "") -> "Acceptance":
        """Both together, scaled down to KEEP forwards' worth where they hold more (the older weigh less)."""
        s = min(1.0, KEEP / max(self.forwards + other.forwards, 1))
        summed = {f: (getattr(self, f) + getattr(other, f)) * s for f in FIELDS}
        return replace(
            self,
            **summed,
            runs=self.runs + runs,
            updated=updated or self.updated,
            total=self.total + max(other.total, other.forwards),  # a run's own count, before its figures decayed
        )

    def add(self, stats: dict, new_tokens: int) -> "Acceptance":
        """This record with a generation's `stats` (common/settings.py SpecStats.as_dict) added; tokens a grammar
        forced (always accepted, whatever the draft) are left out."""
        v = stats.get("verifications", 0)
        forwards = v + stats.get("plain_steps", 0)
        if not forwards:
            return self
        forced = stats.get("forced", 0)
        got = Acceptance(
            v,
            stats.get("accepted", 0) - forced,
            forwards,
            new_tokens - forced,
            stats.get("drafted", 0),
            stats.get("draft_forwards", 0),
        )
        return self.plus(got)


def learning() -> bool:
    return os.environ.get("CADENCE_LEARN", "1") != "0"


RECORDS = 2  # the records' generation: those of 1 were written by runs whose governor, after a first tree that
# missed, could step plainly to the end (speculative/governor.py before 2026-11-30), measuring a draft far below what
# it gives; they are not read


def key(target_dir, draft_dir, head_rows: int) -> str:
    """The pair: the target's store, the draft's (None: the trie alone) and the token rows its head keeps."""
    generation = f" {RECORDS}" if draft_dir else ""  # the trie alone's records stand: no draft budget priced them
    return hashlib.sha256(f"{target_dir} {draft_dir or ''} {head_rows}{generation}".encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Expected:
    """What a plan prices a draft's tree with: the tokens a verification writes, its rows and draft forwards (None:
    the width's), and the tokens a forward of the trie alone writes; `said`: the line a plan says of them."""

    gives: float
    alone_gives: float
    shape: tuple[float, float] | None
    said: str
    stale: bool = False  # the record speaks, but the trie alone ran RETRY forwards or more since: measure it again


def expected(target_dir, draft_dir, head_rows: int) -> Expected:
    """As measured here where enough was, else TOKENS_PER_VERIFICATION at the run's width, and one token a forward
    for the trie alone. A draft's record that the trie alone has run RETRY forwards past since it last grew (a plan
    that dropped the draft on it never measures it again, and the workload may have changed) prices by the rule
    once more: where the rule keeps the draft, the run measures it again."""
    got, alone = read(key(target_dir, draft_dir, head_rows)), read(key(target_dir, None, 0))
    stale = got.speaks and alone.total - got.alone_at >= RETRY
    if not got.speaks:
        lines = [f"the draft {TOKENS_PER_VERIFICATION} tokens a verification (assumed: too few measured here yet)"]
    elif stale:
        lines = [
            got.describe("the draft")
            + f", before the trie alone ran {alone.total - got.alone_at:.0f} forwards here: to be measured again"
            + (
                f", priced as assumed ({TOKENS_PER_VERIFICATION} tokens a verification) meanwhile"
                if got.per_verification() < TOKENS_PER_VERIFICATION
                else ""
            )
        ]
    else:
        lines = [got.describe("the draft")]
    alone_speaks = alone.forwards >= MIN_VERIFICATIONS
    lines += [alone.describe("the trie alone", forward=True)] if alone_speaks else []
    # a stale record only ever makes the draft likelier to run: its figure where it measured more than the rule
    measured = got.speaks and (not stale or got.per_verification() >= TOKENS_PER_VERIFICATION)
    return Expected(
        got.per_verification() if measured else TOKENS_PER_VERIFICATION,
        alone.per_forward() if alone_speaks else 1.0,
        got.shape() if measured else None,  # None: the width's
        "acceptance: " + "; ".join(lines),
        stale,
    )


def of_plan(plan) -> str:
    """The key of a run's pair (engine/plan.py RunPlan)."""
    d = plan.draft
    return key(plan.target.dir, d.store.dir if d.model else None, d.head_rows)


def alone_of(plan) -> str | None:
    """Where a run's pair has a draft model, the key of its target's trie alone (`record`'s `alone`)."""
    return key(plan.target.dir, None, 0) if plan.draft.model else None


def _path(k: str):
    return paths.home() / "calibration" / f"accept-{k}.json"


def read(k: str) -> Acceptance:
    """The pair's record (empty where none was kept or it cannot be read, or CADENCE_LEARN=0)."""
    if not learning():
        return Acceptance()
    try:
        got = Acceptance(**json.loads(_path(k).read_text()))
        figures = {f: float(getattr(got, f)) for f in (*FIELDS, "total", "alone_at")}
        return replace(got, **figures, runs=int(got.runs))  # figures, not text
    except (OSError, ValueError, TypeError):
        return Acceptance()


def record(k: str, measured: Acceptance, ended: bool = True, alone: str | None = None) -> Acceptance:
    """A run's figures (a server's since the last) for the pair added to what is kept, and kept (a home that cannot
    be written keeps nothing); `ended`: the run is over (it counts as one more); `alone`: a draft's pair, the key of
    its target's trie alone (whose forwards since tell when to measure the draft again: `expected`)."""
    if not (measured.forwards and learning()):
        return read(k)
    old, clock = read(k), read(alone).total if alone else 0.0
    if alone and old.speaks and clock - old.alone_at >= RETRY:  # measured again after long: the old figures go
        old = Acceptance(runs=old.runs, total=old.total)
    out = old.plus(measured, runs=int(ended), updated=time.strftime("%Y-%m-%d %H:%M"))
    out = replace(out, alone_at=clock) if alone else out
    try:
        keep(_path(k), asdict(out))
    except OSError:
        pass
    return out
