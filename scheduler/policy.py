"""The pipeline policy: which role does what next. A pure state machine: no processes, no I/O.

Events go in (what an actor reported), actions come out (what to ask of whom). The driver
(`scheduler/pipeline.py`) turns actions into requests and replies into events; tests drive it
with a tiny simulator instead.

One generation step (LLMCad's loop, streamed target):
- draft: `draft_step` until the tree confidence Tc drops below alpha or the tree reaches
  `verify_width` (the fallback), then verification starts;
- loader: fills free streaming slots with target layers in order, never past `stream_bytes`,
  already during drafting;
- verifier (+ sparse worker, by the partition ratios): layer i as soon as it is loaded; a
  layer's slot is released once both parts are done;
- last layer: n accepted -> tokens += n + 1, alpha adapts, the next tree starts;
- while the verifier waits on the loader, the draft drafts ahead (speculatively); with
  `draft_shares_unit` the two models never compute at once.
Loads are numbered by a global sequence `seq`: layer `seq % n_layers` of round `seq // n_layers`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.config import PartitionConfig, PipelineConfig


@dataclass(frozen=True)
class Action:
    role: str
    op: str
    args: dict = field(default_factory=dict)
    slot: str | None = None  # key of the streaming slot this action writes or reads
    alloc_bytes: int = 0  # > 0: allocate `slot` with this many bytes first (a load)


@dataclass(frozen=True)
class Release:
    slot: str  # the slot's bytes may be reused


@dataclass(frozen=True)
class Drafted:
    conf: float  # confidence of the token just drafted
    epoch: int  # trees discarded since; a stale step is ignored


@dataclass(frozen=True)
class Loaded:
    seq: int


@dataclass(frozen=True)
class LayerDone:
    seq: int
    part: str  # "dense" (verifier) or "sparse" (CPU worker)
    accepted: int | None = None  # on the last layer's dense part


def _key(seq: int) -> str:
    return f"s{seq}"


class PipelinePolicy:
    def __init__(self, pipeline: PipelineConfig, partition: PartitionConfig, stream_bytes: int, align: int = 4096):
        self.cfg = pipeline
        self.part = partition
        self.slot_bytes = -(-pipeline.layer_bytes // align) * align
        self.stream_bytes = stream_bytes
        self.alpha = pipeline.alpha
        self.tokens = self.rounds = 0
        self.done = False
        self.busy: set[str] = set()  # roles computing now
        self.held = self.peak_held = 0  # bytes of slots allocated and not yet released
        self.phase = "draft"  # "draft" | "verify"
        self.tree, self.tc, self.epoch = 0, 1.0, 0  # the tree being drafted
        self.verify_tree = 0  # size of the tree under verification
        self.next_load = self.loads_inflight = 0
        self.loaded: set[int] = set()  # loaded, not yet verified
        self.next_verify = 0
        self.parts_left: set[str] = set()
        self.accepted: int | None = None

    # -- events -> actions -----------------------------------------------------------------------

    def start(self) -> list:
        return self._next()

    def on(self, ev) -> list:
        out: list = []
        if isinstance(ev, Drafted):
            self.busy.discard("draft")
            if ev.epoch == self.epoch and not self.done:
                self.tree += 1
                self.tc *= ev.conf
                if self.phase == "draft" and (self.tc < self.alpha or self.tree >= self.cfg.verify_width):
                    self.phase, self.verify_tree = "verify", self.tree  # fallback: verify this tree
                    self.tree, self.tc = 0, 1.0  # and draft the next one ahead
        elif isinstance(ev, Loaded):
            self.loads_inflight -= 1
            if self.done:
                out.append(self._release(ev.seq))
            else:
                self.loaded.add(ev.seq)
        elif isinstance(ev, LayerDone):
            self.parts_left.discard(ev.part)
            if ev.accepted is not None:
                self.accepted = ev.accepted
            if not self.parts_left:
                self.busy -= {"verifier", "sparse"}
                self.loaded.discard(ev.seq)
                out.append(self._release(ev.seq))
                self.next_verify += 1
                if self.next_verify % self.cfg.n_layers == 0:
                    out += self._finish_round()
        else:
            raise TypeError(f"unknown pipeline event {ev!r}")
        return out + self._next()

    def event_for(self, action: Action, result: dict):
        """The event a successful reply to `action` stands for."""
        a = action.args
        if action.op == "draft_step":
            return Drafted(float(result["conf"]), a["epoch"])
        if action.op == "load":
            return Loaded(a["seq"])
        if action.op == "verify_layer":
            return LayerDone(a["seq"], "dense", result.get("accepted"))
        if action.op == "sparse_attn":
            return LayerDone(a["seq"], "sparse")
        raise ValueError(f"no pipeline event for op {action.op!r}")

    # -- internals ---------------------------------------------------------------------------------

    def _release(self, seq: int) -> Release:
        self.held -= self.slot_bytes
        return Release(_key(seq))

    def _finish_round(self) -> list:
        n = max(0, min(self.accepted or 0, self.verify_tree))
        self.tokens += n + 1  # the accepted prefix plus the target's own next token
        self.rounds += 1
        self.accepted = None
        step = self.cfg.alpha_step
        # all accepted: the draft was right to go on, so fall back later; else sooner
        self.alpha = self.alpha * (1 - step) if n == self.verify_tree else min(0.99, self.alpha * (1 + step))
        if n < self.verify_tree:
            self.tree, self.tc, self.epoch = 0, 1.0, self.epoch + 1  # drafted-ahead tokens built on a rejected path
        self.phase = "draft"
        if self.tokens >= self.cfg.max_tokens:
            self.done = True
            return [self._release(s) for s in sorted(self.loaded)]  # prefetched layers nobody will verify
        return []

    def _next(self) -> list:
        if self.done:
            return []
        out: list = []
        cfg = self.cfg
        while self.loads_inflight < cfg.load_depth and self.held + self.slot_bytes <= self.stream_bytes:
            s = self.next_load
            out.append(Action("loader", "load", {"seq": s, "layer": s % cfg.n_layers},
                              slot=_key(s), alloc_bytes=self.slot_bytes))
            self.held += self.slot_bytes
            self.peak_held = max(self.peak_held, self.held)
            self.next_load += 1
            self.loads_inflight += 1
        shared = cfg.draft_shares_unit and "draft" in self.busy
        if self.phase == "verify" and "verifier" not in self.busy and self.next_verify in self.loaded and not shared:
            out += self._verify(self.next_verify)
        if "draft" not in self.busy:
            ahead = self.phase == "verify" and "verifier" not in self.busy and self.tree < cfg.verify_width
            if self.phase == "draft" or ahead:
                self.busy.add("draft")
                out.append(Action("draft", "draft_step", {"epoch": self.epoch, "tree": self.tree, "ahead": ahead}))
        return out

    def _verify(self, seq: int) -> list:
        layer = seq % self.cfg.n_layers
        base = {"seq": seq, "layer": layer, "tree": self.verify_tree}
        out = [Action("verifier", "verify_layer",
                      {**base, "share": 1.0 - self.part.linear_cpu_share, "last": layer == self.cfg.n_layers - 1},
                      slot=_key(seq))]
        self.busy.add("verifier")
        self.parts_left = {"dense"}
        if self.part.attn_sparse_share > 0 or self.part.linear_cpu_share > 0:
            out.append(Action("sparse", "sparse_attn",
                              {**base, "attn_share": self.part.attn_sparse_share, "linear_share": self.part.linear_cpu_share},
                              slot=_key(seq)))
            self.busy.add("sparse")
            self.parts_left.add("sparse")
        return out
