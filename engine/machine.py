"""What `decide` (engine/decide.py) knows of the machine it plans for, asked through one object.

`ThisMachine` answers from this machine: the weight stores (converted on first use), the models pulled here
and which can draft for which (engine/drafts.py), an ARCA profile's file, the memory and cores, the runtime's
overheads (scheduler/generation/footprint.py: this process's own memory read once, when first asked, so
every plan `decide` weighs counts the same scheduler), and the forward and disk costs of a store pair
(engine/costs.py, measured once and cached). It remembers every answer: asked twice, it answers the same,
so `decide(cfg, machine)` twice gives the same plan.
"""

from __future__ import annotations

import os
import sys
from typing import Callable

from common.errors import CadenceError
from common.units import machine_memory
from formats.store import WeightStore


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class ThisMachine:
    def __init__(self, say: Callable[[str], None] | None = None, own: int | None = None):
        """`say`: where a line about slow work done for the plan goes (a measurement); default stderr. `own`: the
        anonymous bytes the run's scheduler process holds (default: this process's, read at the first plan)."""
        self.say = say or _stderr
        self.memory = machine_memory()
        self.cores = os.cpu_count() or 1
        self._stores: dict[tuple[str, str], WeightStore] = {}
        self._overheads: dict[tuple, object] = {}
        self._costs: dict[tuple, object] = {}
        self._profiles: dict[str, dict] = {}
        self._picks: dict[str, tuple] = {}
        self._own = own

    def store(self, model: str, fmt: str) -> WeightStore:
        """`model`'s weight store in format `fmt` (converted now, with progress bars, on first use)."""
        key = (model, fmt)
        if key not in self._stores:
            from formats.convert import ensure_store

            self._stores[key] = ensure_store(model, fmt)
        return self._stores[key]

    def profile(self, path: str) -> dict:
        if path not in self._profiles:
            from engine.profiles import load_profile

            self._profiles[path] = load_profile(path)
        return self._profiles[path]

    def check_draft(self, target: str, draft: str) -> None:
        """One sentence where `draft` does not share `target`'s vocabulary (read without converting either)."""
        from engine import drafts

        drafts.check_draft(target, draft)

    def pick_draft(self, target: str) -> tuple[str | None, bool]:
        """(the model here that can draft for `target`, or None; whether the default draft shares its tokenizer)."""
        if target not in self._picks:
            from engine import drafts

            self._picks[target] = (drafts.pick(target), drafts.default_shares(target))
        return self._picks[target]

    def expert_paths(self, store: WeightStore):
        """A mixture of experts' path profile beside its store, or None where it has none."""
        from pathlib import Path

        from scheduler.generation.expert_policy import PATHS_FILE, PathStats

        path = Path(store.dir) / PATHS_FILE
        return PathStats.load(path) if path.exists() else None

    def overheads(self, target: WeightStore, draft: WeightStore | None, **shape):
        """The runtime's overheads for a run of this pair and shape (measure_overheads' keywords)."""
        key = (str(target.dir), str(draft.dir) if draft else None, tuple(sorted(shape.items())))
        if key not in self._overheads:
            from scheduler.generation.footprint import measure_overheads, own_anon_bytes

            if self._own is None:
                self._own = own_anon_bytes()
            self._overheads[key] = measure_overheads(
                target.args.to_dict(), draft.args.to_dict() if draft else None, own=self._own, **shape
            )
        return self._overheads[key]

    def costs(self, target: WeightStore, draft: WeightStore | None):
        """This machine's forward and disk costs for the pair (engine/costs.py), or None where measuring failed:
        said in one line, and the choices that need them keep what was asked."""
        key = (str(target.dir), str(draft.dir) if draft else None)
        if key not in self._costs:
            from engine.costs import costs

            try:
                self._costs[key] = costs(target, draft, self.say)
            except CadenceError as e:
                self.say(f"{e}: the draft and width stay as asked (--draft NAME and --width N skip the measurement)")
                self._costs[key] = None
        return self._costs[key]
