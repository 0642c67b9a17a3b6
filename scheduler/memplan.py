"""The memory plan under a budget: what stays resident, what streams, in how many slots.

    draft weights + KV caches + activations + process overhead + exchange area
      + target groups kept resident + streaming slots  <=  budget

Target groups are `layer.0 .. layer.N-1` and `head`; the embedding table stays on disk (rows are
read per token). The head is kept resident first (it is the largest group: streaming it would make
every slot that large), then as many layers as fit beside two or three streaming slots sized for
the largest group still streamed; those layers are spread between the streamed ones, so that the
loader reads while the verifier computes a resident layer (see `_spread`). A budget
that cannot hold the fixed part and two slots is refused with the shortfall and the smallest
budget that works.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cadence.errors import CadenceError

MiB = 1 << 20
ALIGN = 4096


def fmt(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / MiB:.0f} MiB"


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class Overheads:
    """What the runtime holds beyond model data, part by part (anonymous + shared memory, what a
    memory cgroup charges). `measure_overheads` fills it from this machine; the defaults are what it
    measured on the development machine (2026-11-22: Python 3.11, torch 2.13.0 CPU)."""
    scheduler: int = 96 * MiB  # the launch process: interpreter, tokenizer, monitor, trace buffers
    runtime: int = 160 * MiB  # the zygote: interpreter, torch, kernels, model code, shared by every actor forked from it
    actor: int = 16 * MiB  # what each model actor writes beyond its data: stacks, thread pool, copied pages
    loader: int = 4 * MiB
    watchdog: int = 8 * MiB
    exchange: int = 16 * MiB  # the arena part for tensors other than streamed layers
    verifier_activations: int = 48 * MiB  # a prefill chunk's intermediates, a verification's logits
    draft_activations: int = 24 * MiB

    def fixed(self, draft: bool) -> int:
        """Everything but model data and the loader, for a run with or without a draft actor."""
        return (self.scheduler + self.watchdog + self.runtime + self.exchange + self.actor + self.verifier_activations
                + ((self.actor + self.draft_activations) if draft else 0))


@dataclass(frozen=True)
class MemoryPlan:
    budget: int
    draft_weights: int
    draft_kv: int
    target_kv: int
    fixed: int  # everything above plus overheads and the exchange area
    resident: tuple[str, ...]
    streamed: tuple[str, ...]
    resident_bytes: int
    slot_bytes: int
    n_slots: int
    overheads: Overheads

    @property
    def stream_bytes(self) -> int:
        return self.slot_bytes * self.n_slots

    @property
    def arena_bytes(self) -> int:
        return self.stream_bytes + self.overheads.exchange

    @property
    def total(self) -> int:
        return self.fixed + self.resident_bytes + self.stream_bytes

    @property
    def has_draft(self) -> bool:
        return self.draft_weights > 0

    def lines(self) -> list[tuple[str, int]]:
        o = self.overheads
        actors = 2 if self.has_draft else 1
        return [("draft weights", self.draft_weights), ("KV caches", self.draft_kv + self.target_kv),
                ("scheduler process", o.scheduler + o.watchdog),
                (f"actors' code (zygote, shared by {actors + bool(self.streamed)})",
                 o.runtime + actors * o.actor + (o.loader if self.streamed else 0)),
                ("activations", o.verifier_activations + (o.draft_activations if self.has_draft else 0)),
                ("exchange arena", o.exchange),
                (f"target resident ({len(self.resident)} groups)", self.resident_bytes),
                (f"streaming slots ({self.n_slots} x {fmt(self.slot_bytes)})", self.stream_bytes)]

    def report(self) -> str:
        rows = [f"  {name:<34} {fmt(n):>10}" for name, n in self.lines()]
        rows.append(f"  {'total':<34} {fmt(self.total):>10} of {fmt(self.budget)} budget")
        return "\n".join(rows)


def plan_memory(budget: int, target_groups: dict[str, int], draft_weights: int, draft_kv: int, target_kv: int,
                overheads: Overheads = Overheads(), max_slots: int = 3) -> MemoryPlan:
    """`target_groups`: bytes of each streamable target group (layers in order, then head)."""
    o = overheads
    streaming_overhead = o.loader
    fixed = draft_weights + draft_kv + target_kv + o.fixed(draft=draft_weights > 0)
    names = list(target_groups)
    sizes = {n: _align(b) for n, b in target_groups.items()}
    everything = sum(sizes.values())
    if fixed + everything <= budget:  # all resident: nothing streams
        return MemoryPlan(budget, draft_weights, draft_kv, target_kv, fixed, tuple(names), (), everything, 0, 0, o)
    fixed += streaming_overhead
    slot = max(sizes.values())
    others = [b for n, b in sizes.items() if n != "head"]
    smallest = fixed + 2 * slot  # everything streams through slots as large as the largest group
    if "head" in sizes and others:  # or the head stays and the slots are only layer-sized
        smallest = min(smallest, fixed + sizes["head"] + 2 * max(others))
    if budget < smallest:
        raise CadenceError(
            f"a memory budget of {fmt(budget)} is too small: it must hold "
            f"{f'the draft ({fmt(draft_weights)}), ' if draft_weights else ''}the KV "
            f"caches ({fmt(draft_kv + target_kv)}), the runtime's processes and activations "
            f"({fmt(fixed - draft_weights - draft_kv - target_kv)}) and two streaming slots; "
            f"the smallest budget that works is {fmt(smallest)}")
    order = (["head"] if "head" in sizes else []) + [n for n in names if n != "head"]
    resident: list[str] = []
    held = 0
    for n in order:
        rest = [m for m in order if m not in resident and m != n]
        if not rest:
            break  # keep at least one group streaming: everything did not fit
        slot_if = max(sizes[m] for m in rest)
        if fixed + held + sizes[n] + 2 * slot_if <= budget:
            resident.append(n)
            held += sizes[n]
        else:
            break
    resident = _spread(resident, names, sizes, budget - fixed)
    held = sum(sizes[n] for n in resident)
    streamed = [n for n in names if n not in resident]  # in the order a forward needs them
    slot = max(sizes[n] for n in streamed)
    n_slots = 3 if fixed + held + 3 * slot <= budget and len(streamed) >= 3 else 2
    return MemoryPlan(budget, draft_weights, draft_kv, target_kv, fixed, tuple(n for n in names if n in resident),
                      tuple(streamed), held, slot, n_slots, o)


def _spread(resident: list[str], names: list[str], sizes: dict[str, int], room: int) -> list[str]:
    """The same number of resident layers, spread between the streamed ones, the first layer streamed.

    The slots hold the next streamed layers while the verifier computes resident ones, and a
    loader with every slot full stands idle. With the resident layers first, each forward began
    with all of their compute while the loader waited for a free slot; spread out, every
    resident layer is computed while the loader reads the next streamed one into the slot the
    previous streamed layer freed. Kept as chosen if the spread set would not fit (layers of
    unequal size)."""
    layers = [n for n in names if n != "head"]
    kept = [n for n in resident if n != "head"]
    s = len(layers) - len(kept)
    if not kept or s <= 0:
        return resident
    streamed = {layers[i * len(layers) // s] for i in range(s)}
    spread = [n for n in resident if n == "head"] + [n for n in layers if n not in streamed]
    rest = [n for n in names if n not in spread]
    if sum(sizes[n] for n in spread) + 2 * max(sizes[n] for n in rest) > room:
        return resident
    return spread


PREFILL_CHUNK = 256  # models/engine.py: prompt rows per forward


def activation_bytes(args, rows: int) -> int:
    """A forward's largest transient tensors: a prefill chunk's intermediates in one layer (the
    residual, the q/k/v, attention output, the FFN's gate|up and product, int8 copies of inputs),
    and the logits (and probabilities) of a verification of `rows` tokens. `args`: a ModelArgs dict."""
    a = args if isinstance(args, dict) else args.to_dict()
    q, kv = a["n_heads"] * a["head_dim"], a["n_kv_heads"] * a["head_dim"]
    layer = PREFILL_CHUNK * (4 * a["dim"] + 2 * q + 2 * kv + 3 * a["ffn_dim"]) * 4
    return _align(layer + 2 * rows * a["vocab_size"] * 4)


def measure_overheads(target_args, draft_args=None, width: int = 8) -> Overheads:
    """The overheads of a run on this machine: the scheduler as this process holds it now (call it
    once the tokenizer is loaded), the actors' shared code as calibrated once (`runtime_bytes`),
    activations from the models' shapes."""
    rows = min(width, 64) + 1 + 8  # a tree, its root and trie candidates
    return Overheads(scheduler=_align(own_anon_bytes() + 16 * MiB),  # + trace buffers and the monitor as the run goes
                     runtime=runtime_bytes(),
                     verifier_activations=activation_bytes(target_args, rows),
                     draft_activations=activation_bytes(draft_args, rows) if draft_args is not None else 0)


def own_anon_bytes() -> int:
    """This process's anonymous memory (what a cgroup charges it, file pages aside)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("RssAnon"))
    except (OSError, StopIteration):
        return Overheads.scheduler


ACTOR_MODULES = ("actors.verifier", "actors.draft")


def runtime_bytes() -> int:
    """What the zygote holds once it has imported the actors' code (torch, kernels, models),
    measured once per Python, torch and cadence version and cached under $CADENCE_HOME."""
    import hashlib
    import json
    import subprocess
    import sys

    from cadence import paths
    from shm.watchdog import REPO_ROOT, python_env

    src = hashlib.sha256()
    for d in ("actors", "models", "speculative", "cadence"):
        for f in sorted(Path(REPO_ROOT, d).glob("*.py")):
            src.update(f.read_bytes())
    key = hashlib.sha256(f"{sys.version} {sys.executable} {src.hexdigest()}".encode()).hexdigest()[:16]
    cache = paths.home() / "calibration" / f"runtime-{key}.json"
    try:
        return int(json.loads(cache.read_text())["runtime_bytes"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    code = ("import actors.zygote as z, sys; z.preload(sys.argv[1:]); "
            "print(next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('RssAnon')))")
    proc = subprocess.run([sys.executable, "-c", code, *ACTOR_MODULES], capture_output=True, text=True,
                          env=python_env(), timeout=300)
    try:
        n = _align(int(proc.stdout.strip().splitlines()[-1]))
    except (ValueError, IndexError):
        return Overheads.runtime  # measuring failed (its own error shows when the actors start)
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps({"runtime_bytes": n, "python": sys.version, "modules": ACTOR_MODULES}))
    except OSError:
        pass  # a read-only home: measured again next time
    return n


def parse_bytes(text: str) -> int:
    """'3GiB', '2.5G', '800MiB', '1000000000' -> bytes."""
    t = text.strip().lower().replace(" ", "")
    units = {"gib": 2**30, "gb": 10**9, "g": 2**30, "mib": 2**20, "mb": 10**6, "m": 2**20, "kib": 2**10, "kb": 10**3,
             "k": 2**10, "b": 1}
    for u, mult in units.items():
        if t.endswith(u):
            try:
                return int(float(t[: -len(u)]) * mult)
            except ValueError:
                break
    try:
        return int(t)
    except ValueError:
        raise CadenceError(f"cannot read the memory size {text!r}; write it like 3GiB, 800MiB or a number of bytes") from None
