"""The memory plan under a budget: what stays resident, what streams, in how many slots.

    draft weights + KV caches + activations + the runtime's processes + exchange area + code pages
      + target groups kept resident + streaming slots  <=  budget

Target groups are `layer.0 .. layer.N-1` and the output head's parts `head.0 .. head.P-1`, each
about a layer's bytes (formats/convert.py); the embedding table stays on disk (rows are read per
token). As many groups as fit stay resident beside two or three streaming slots sized for the
largest group still streamed, spread between the streamed ones so that the loader reads while the
verifier computes a resident group (see `_spread`). A budget that cannot hold the fixed part and
two slots is refused with the shortfall and the smallest budget that works.

The fixed part is measured, not guessed (footprint.py `measure_overheads`): the scheduler as this process holds
it, the zygote and each actor's own pages as calibrated on this machine (scheduler/generation/footprint.py),
the activations from the models' shapes at the widths the run uses, the KV caches at the context
it needs. `MemoryPlan.held` is what the run's processes hold (anonymous and shared memory, what a
cgroup charges besides the page cache); `total` adds room for their code pages.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from common.errors import CadenceError
from common.units import fmt, fmt_up

MiB = 1 << 20
ALIGN = 4096


def align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class Overheads:
    """What the runtime holds beyond model data, part by part (anonymous + shared memory, what a
    memory cgroup charges), plus the page cache its code needs. `measure_overheads` fills it from
    this machine; the defaults are what it measured on the development machine (2026-11-23:
    Python 3.11, torch 2.13.0 CPU, Qwen2.5-Coder 1.5B target and 0.5B draft at width 8)."""

    scheduler: int = 96 * MiB  # the launch process: interpreter, tokenizer, monitor, trace buffer
    watchdog: int = 8 * MiB  # the process that cleans up after a scheduler that died
    runtime: int = (
        155 * MiB
    )  # the zygote: interpreter, torch, kernels, model code, shared by every actor forked from it
    actor: int = (
        6 * MiB
    )  # what each actor (verifier, draft, loader) writes beyond its data: stacks, sockets, copied pages
    exchange: int = 1 * MiB  # the arena part for tensors other than streamed groups (sampling distributions)
    verifier_activations: int = 24 * MiB  # a prefill chunk's intermediates, a verification's logits
    draft_activations: int = 16 * MiB  # the same for the draft, and its n-gram trie
    code: int = 32 * MiB  # page cache for the processes' code (libtorch, libpython, kernels): not theirs to lose
    grammar: int = 0  # where requests may hold their output to a grammar: its view of the vocabulary, in each process
    # that matches one (speculative/grammar.py: the actors share the zygote's; a scheduler whose trie drafts holds its own)
    prompt_cache: int = 0  # the prompt cache's entries in the verifier's memory (speculative/prefixes.py)

    def held(self, draft: bool, streamed: bool) -> int:
        """Everything but model data, KV and code pages, for a run with or without a draft, streaming or not."""
        return (
            self.scheduler
            + self.watchdog
            + self.runtime
            + self.exchange
            + self.actor
            + self.verifier_activations
            + ((self.actor + self.draft_activations) if draft else 0)
            + (self.actor if streamed else 0)
            + self.grammar
            + self.prompt_cache
        )


@dataclass(frozen=True)
class MemoryPlan:
    budget: int
    draft_weights: int
    draft_kv: int
    target_kv: int
    fixed: int  # everything but the target's resident groups and the slots, code pages included
    resident: tuple[str, ...]
    streamed: tuple[str, ...]
    resident_bytes: int
    slot_bytes: int
    n_slots: int
    overheads: Overheads
    smallest: int = 0  # the smallest budget this plan's fixed part works with
    group_bytes: dict = field(default_factory=dict)  # each target group's bytes (aligned)
    expert_buffer: int = 0  # a mixture of experts under the budget: the arena room for experts read on demand
    experts: int = 0  # how many experts the store has (0: a dense model, or every expert resident)
    expert_bytes: int = 0  # the largest expert's bytes
    draft_choice: tuple = ()  # a draft sized by the run's engine (--draft flash: predictor, neurons cached a layer)

    @property
    def stream_bytes(self) -> int:
        """What the loader may fill: the streaming slots, then the expert buffer."""
        return self.slot_bytes * self.n_slots + self.expert_buffer

    @property
    def arena_bytes(self) -> int:
        return self.stream_bytes + self.overheads.exchange

    @property
    def total(self) -> int:
        return self.fixed + self.resident_bytes + self.stream_bytes

    @property
    def held(self) -> int:
        """What the processes hold (anonymous + shared memory): the total less the code pages."""
        return self.total - self.overheads.code

    @property
    def has_draft(self) -> bool:
        return self.draft_weights > 0

    @property
    def read_per_forward(self) -> int:
        """Bytes the loader reads for every target forward (every streamed group, once)."""
        return sum(self.group_bytes.get(g, self.slot_bytes) for g in self.streamed)

    def lines(self) -> list[tuple[str, int]]:
        o = self.overheads
        actors = 1 + self.has_draft + bool(self.streamed or self.expert_buffer)
        return [
            ("draft weights", self.draft_weights),
            ("KV caches", self.draft_kv + self.target_kv),
            ("scheduler + watchdog", o.scheduler + o.watchdog),
            (f"actors' code (zygote, shared by {actors})", o.runtime + actors * o.actor),
            ("activations", o.verifier_activations + (o.draft_activations if self.has_draft else 0)),
            ("exchange arena", o.exchange),
            *([("grammars' view of the vocabulary", o.grammar)] if o.grammar else []),
            *([("prompt cache (in memory)", o.prompt_cache)] if o.prompt_cache else []),
            (f"target resident ({len(self.resident)} groups)", self.resident_bytes),
            (f"streaming slots ({self.n_slots} x {fmt(self.slot_bytes)})", self.slot_bytes * self.n_slots),
            *(
                [(f"expert buffer (~{self.expert_slots} of {self.experts} experts)", self.expert_buffer)]
                if self.experts
                else []
            ),
            ("code pages (page cache)", o.code),
        ]

    @property
    def expert_slots(self) -> int:
        """Experts the buffer holds at the largest expert's size."""
        return self.expert_buffer // self.expert_bytes if self.expert_bytes else 0

    def report(self) -> str:
        rows = [f"  {name:<40} {fmt(n):>10}" for name, n in self.lines()]
        rows.append(f"  {'total':<40} {fmt(self.total):>10} of {fmt(self.budget)} budget")
        return "\n".join(rows)

    def summary(self) -> str:
        """The plan in one line (what `launch run` prints at start)."""
        if self.experts:
            layers = (
                f"{len(self.streamed)} streamed through {self.n_slots} slots of {fmt(self.slot_bytes)}"
                if self.streamed
                else "all resident"
            )
            return (
                f"memory plan: {fmt(self.total)} of {fmt(self.budget)}: non-expert groups {layers}; "
                f"experts read on demand into a {fmt(self.expert_buffer)} buffer (~{self.expert_slots} of {self.experts})"
            )
        if not self.streamed:
            return f"memory plan: {fmt(self.total)} of {fmt(self.budget)}, every target group resident"
        return (
            f"memory plan: {fmt(self.total)} of {fmt(self.budget)}: {len(self.resident)} target groups resident, "
            f"{len(self.streamed)} streamed through {self.n_slots} slots of {fmt(self.slot_bytes)} "
            f"({fmt(self.read_per_forward)} read per forward)"
        )


def smallest_budget(
    target_groups: dict[str, int],
    draft_weights: int,
    draft_kv: int,
    target_kv: int,
    overheads: Overheads = Overheads(),
    experts: dict[str, int] | None = None,
    experts_used: int = 0,
) -> int:
    """The smallest budget a plan works with: the fixed part, streaming, and two slots for the largest group
    (and room for one token's experts)."""
    o = overheads
    fixed = draft_weights + draft_kv + target_kv + o.code + o.held(draft_weights > 0, streamed=True)
    one_token = max(experts_used, 1) * max(align(b) for b in experts.values()) if experts else 0
    return fixed + 2 * max(align(b) for b in target_groups.values()) + one_token


def plan_memory(
    budget: int,
    target_groups: dict[str, int],
    draft_weights: int,
    draft_kv: int,
    target_kv: int,
    overheads: Overheads = Overheads(),
    max_slots: int = 3,
    experts: dict[str, int] | None = None,
    experts_used: int = 0,
) -> MemoryPlan:
    """`target_groups`: bytes of each streamable target group, in the order a forward needs them
    (layers, then the head's parts). `experts`: a mixture of experts' expert groups and their bytes;
    `experts_used`: how many experts a token routes to.

    A mixture of experts keeps what every token uses (attention, routers, shared experts) resident
    where it fits and gives the rest of the budget to an expert buffer (EdgeMoE §3.3), which must hold
    at least one token's experts; where the non-expert groups do not fit beside that buffer, they
    stream as a dense model's layers do and the buffer gets what their plan leaves."""
    if experts:
        return _plan_moe(
            budget, target_groups, draft_weights, draft_kv, target_kv, overheads, max_slots, experts, experts_used
        )
    o = overheads
    draft = draft_weights > 0
    data = draft_weights + draft_kv + target_kv + o.code
    names = list(target_groups)
    sizes = {n: align(b) for n, b in target_groups.items()}
    everything = sum(sizes.values())
    fixed = data + o.held(draft, streamed=False)
    if fixed + everything <= budget:  # all resident: nothing streams
        resident, held, smallest, slot, n_slots = names, everything, fixed + everything, 0, 0
    else:
        fixed = data + o.held(draft, streamed=True)
        smallest = fixed + 2 * max(sizes.values())
        if budget < smallest:
            raise CadenceError(
                f"a memory budget of {fmt(budget)} is too small: it must hold "
                f"{f'the draft ({fmt(draft_weights)}), ' if draft else ''}the KV "
                f"caches ({fmt(draft_kv + target_kv)}), the runtime's processes, activations and code "
                f"({fmt(fixed - draft_weights - draft_kv - target_kv)}) and two streaming slots "
                f"({fmt(2 * max(sizes.values()))}); the smallest budget that works is {fmt_up(smallest)}"
            )
        resident = _resident(names, sizes, budget - fixed)
        held = sum(sizes[n] for n in resident)
        slot = max(sizes[n] for n in names if n not in resident)
        n_slots = 3 if max_slots >= 3 and fixed + held + 3 * slot <= budget and len(names) - len(resident) >= 3 else 2
    return MemoryPlan(
        budget,
        draft_weights,
        draft_kv,
        target_kv,
        fixed,
        tuple(n for n in names if n in resident),
        tuple(n for n in names if n not in resident),  # in the order a forward needs them
        held,
        slot,
        n_slots,
        o,
        smallest=smallest,
        group_bytes=sizes,
    )


def _resident(names: list[str], sizes: dict[str, int], room: int) -> list[str]:
    """As many groups resident as fit in `room` beside two slots for the largest group still streamed,
    spread between the streamed ones."""
    resident: list[str] = []
    for n in sorted(names, key=lambda n: sizes[n]):
        rest = [m for m in names if m not in resident and m != n]
        if not rest or sum(sizes[m] for m in resident) + sizes[n] + 2 * max(sizes[m] for m in rest) > room:
            break
        resident.append(n)
    return _spread(len(resident), names, sizes, room) or resident


def _plan_moe(
    budget, target_groups, draft_weights, draft_kv, target_kv, o, max_slots, experts, experts_used
) -> MemoryPlan:
    sizes = {n: align(b) for n, b in experts.items()}
    largest, total = max(sizes.values()), sum(sizes.values())
    minimum = max(experts_used, 1) * largest
    data = draft_weights + draft_kv + target_kv + o.code
    dense = {n: align(b) for n, b in target_groups.items()}
    fixed = data + o.held(draft_weights > 0, streamed=False)
    if fixed + sum(dense.values()) + total <= budget:  # everything resident
        plan = plan_memory(budget - total, target_groups, draft_weights, draft_kv, target_kv, o, max_slots)
        return replace(
            plan,
            budget=budget,
            resident=plan.resident + tuple(experts),
            resident_bytes=plan.resident_bytes + total,
            smallest=plan.smallest + total,
            group_bytes={**plan.group_bytes, **sizes},
        )
    fixed = data + o.held(draft_weights > 0, streamed=True)
    if fixed + sum(dense.values()) + minimum <= budget:  # non-expert groups resident, the rest a buffer
        held = sum(dense.values())
        buffer = min(total, (budget - fixed - held) // ALIGN * ALIGN)
        return MemoryPlan(
            budget,
            draft_weights,
            draft_kv,
            target_kv,
            fixed,
            tuple(dense),
            (),
            held,
            0,
            0,
            o,
            smallest=fixed + held + minimum,
            group_bytes={**dense, **sizes},
            expert_buffer=buffer,
            experts=len(sizes),
            expert_bytes=largest,
        )
    smallest = fixed + 2 * max(dense.values()) + minimum
    if budget < smallest:
        raise CadenceError(
            f"a memory budget of {fmt(budget)} is too small: it must hold {f'the draft ({fmt(draft_weights)}), ' if draft_weights else ''}"
            f"the KV caches ({fmt(draft_kv + target_kv)}), the runtime's processes, activations and code "
            f"({fmt(fixed - draft_weights - draft_kv - target_kv)}), two streaming slots ({fmt(2 * max(dense.values()))}) "
            f"and one token's experts ({fmt(minimum)}); the smallest budget that works is {fmt_up(smallest)}"
        )
    plan = plan_memory(budget - minimum, target_groups, draft_weights, draft_kv, target_kv, o, max_slots)
    buffer = minimum + max(0, budget - minimum - plan.total) // ALIGN * ALIGN
    return replace(
        plan,
        budget=budget,
        expert_buffer=min(total, buffer),
        experts=len(sizes),
        expert_bytes=largest,
        smallest=plan.smallest + minimum,
        group_bytes={**plan.group_bytes, **sizes},
    )


def _spread(k: int, names: list[str], sizes: dict[str, int], room: int) -> list[str] | None:
    """k resident groups spread between the streamed ones, the first group streamed; None if that
    set would not fit beside two slots (groups of unequal size).

    The slots hold the next streamed groups while the verifier computes resident ones, and a
    loader with every slot full stands idle. With the resident groups first, each forward began
    with all of their compute while the loader waited for a free slot; spread out, every resident
    group is computed while the loader reads the next streamed one into the slot the previous
    streamed group freed."""
    s = len(names) - k
    if k <= 0 or s <= 0:
        return [] if k <= 0 else None
    streamed = {names[i * len(names) // s] for i in range(s)}
    spread = [n for n in names if n not in streamed]
    if sum(sizes[n] for n in spread) + 2 * max(sizes[n] for n in streamed) > room:
        return None
    return spread
