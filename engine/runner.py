"""The engine of a run, the same for every front door (`launch run`, `chat`, `serve`, `bench`,
`cadence.LLM`): the target and the prompts read (engine/inputs.py), every choice made once
(engine/decide.py: a `RunPlan`), the models loaded behind one `Session` (engine/sessions.py), then prompt
after prompt streams, a `Chunk` per speculation cycle, the last one with the `Completion`.

    with Runner(RunConfig.from_options(memory_budget="1GiB")) as runner:
        for chunk in runner.stream(Prompt("p", "chat", "What is a mutex?")):
            print(chunk.text, end="")
        row = chunk.completion.row

Runtimes: `actors` (the default) runs the verifier and draft as actor processes under the scheduler
(shared-memory tensors, ZeroMQ control, a Chrome trace per run); `inproc` runs the same cycle in
this process.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import sys
from typing import Callable, Iterable, Iterator

from common.errors import CadenceError
from common.settings import SamplingConfig
from engine import acceptance
from engine.config import RunConfig
from engine.costs import Forwards, refresh_compute, refresh_disk
from engine.decide import decide
from engine.inputs import read_inputs
from engine.machine import ThisMachine
from engine.plan import DraftKind, Mode, RunPlan
from engine.prompts import Prompt
from engine.rows import Chunk, Completion, make_row, peak_rss_bytes
from engine.sessions import open_session
from speculative.sides import limits
from text.tokenizer import StreamDecoder


class Runner:
    """Use as a context manager: the actor runtime has processes and shared memory to release."""

    def __init__(self, cfg: RunConfig, prompts: list[Prompt] | None = None, say: Callable[[str], None] | None = None):
        """`prompts`: what will be run, if known: each is encoded once, and the context sized to the longest.
        `say`: where a line about a choice made (the draft `auto` took) goes; default stderr."""
        say = self._say = say or _stderr
        self.trace_path = None
        self._batch = None  # the `--parallel` slots, made at the first ask (`batch`)
        self._joined: dict = {}  # a generation in the batch: its prompt, plan, chat and text decoder
        self._keys = itertools.count()  # `stream_many`'s keys for its generations
        machine = ThisMachine(say)
        # the target converted once, with progress bars, before any actor; the prompts encoded
        self.inputs = read_inputs(cfg, machine, prompts)
        self.tokenizer = self.inputs.tokenizer
        self.inputs.hold_tokenizer(encodes_more=not (cfg.memory_budget and prompts))
        self.plan: RunPlan = decide(cfg, machine, self.inputs.lengths())
        self.inputs.context = self.plan.context
        for line in self.plan.notes:
            say(line)
        self.session = open_session(self.plan)
        self._measured = acceptance.Acceptance()  # what this run's trees gave (engine/acceptance.py)
        self._forwards = Forwards()  # ... and what its target forwards took (engine/costs.py)
        self._open = True
        if self.plan.parallel > 1:  # a generation may take more than a slot's share of the KV pool
            self.inputs.context = self.batch().most_context()

    @property
    def sched(self):
        """The scheduler where the models are actors (until the runner closes), else None."""
        return self.session.sched if getattr(self, "_open", False) else None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        if not getattr(self, "_open", False):
            return
        self._open = False
        if self._batch is not None:
            self._batch.close()
        try:
            self.session.close()  # the loader's figures stay with the streamer
            self._refresh_costs()
            acceptance.record(acceptance.of_plan(self.plan), self._measured, alone=acceptance.alone_of(self.plan))
        finally:
            if self.session.sched is not None:
                self.trace_path = self.session.sched.trace_path

    def _refresh_costs(self) -> None:
        """What the run's loader read, kept as the disk's rate where it shows the kept figure too slow; what its
        target forwards took, as the rows' figures where it shows them too high."""
        streamer = getattr(getattr(self.session, "target", None), "streamer", None)  # --mode flash: no target side
        if streamer is not None and streamer.total.direct:
            refresh_disk(streamer.total.bytes, streamer.total.seconds, self._say)
        if acceptance.learning():
            refresh_compute(self.plan.target, self._forwards, self._say)

    # -- generating -----------------------------------------------------------------------------------

    def run(
        self, prompt: Prompt, mode: str | None = None, on_chunk: Callable[[Chunk], None] | None = None, **kw
    ) -> Completion:
        """`stream` to its end; `on_chunk(chunk)` after each cycle."""
        for chunk in self.stream(prompt, mode, **kw):
            if on_chunk:
                on_chunk(chunk)
        return chunk.completion

    def stream(
        self,
        prompt: Prompt,
        mode: str | None = None,
        max_new_tokens: int | None = None,
        sampling: SamplingConfig | None = None,
        reuse: bool = True,
    ) -> Iterator[Chunk]:
        """The generation for `prompt`, a chunk per cycle (stop tokens are never part of the text), as a member of
        the run's batch (`stream_many` of one prompt); a prompt that cannot run raises its error. A consumer may
        stop early between chunks (a client that went away): each ends a cycle, where the models agree with the
        text, and the next generation starts afresh. `mode` (another of the modes the loaded models run),
        `max_new_tokens` and `sampling` override the run's for this generation. `reuse` False: the whole prompt
        is prefilled (a benchmark comparing modes on one prompt: each pays its own prefill)."""
        for _, chunk in self.stream_many([prompt], mode, max_new_tokens, sampling, reuse):
            if isinstance(chunk, BaseException):
                raise chunk
            yield chunk

    def take_io(self) -> dict:
        """The loader's (and an expert buffer's) figures since the last ask: a batch's, which no one generation's
        row holds (a server adds them to its metrics each cycle). One generation at a time: {} (its row has them)."""
        return self.session.target.take_stats() if self.plan.parallel > 1 else {}

    def batch(self):
        """The run's batch (speculative/batch.py `Lockstep`), made at the first ask: of `--parallel` slots, or of one
        generation over the session's own sides (`Speculation.alone`)."""
        if self._batch is None:
            self._batch = (
                self.session.batch(self.plan.parallel) if self.plan.parallel > 1 else self.session.loop.alone()
            )
        return self._batch

    def stream_many(
        self,
        prompts: Iterable[Prompt],
        mode: str | None = None,
        max_new_tokens: int | None = None,
        sampling: SamplingConfig | None = None,
        reuse: bool = True,
    ) -> Iterator[tuple[Prompt, Chunk | CadenceError]]:
        """Every prompt's generation, `--parallel` at a time together (each prompt joins as a slot frees): (the
        prompt, a chunk of its generation) as each cycle ends, in the order the generations move; a prompt that
        cannot run gets its error instead (the others go on). Each greedy generation's tokens are those it would
        get alone. A consumer that stops early ends the generations under way at the cycle boundary."""
        from speculative.batch import run_all

        prompts = list(prompts)
        keys = {next(self._keys): p for p in prompts}
        join = lambda key, p: self.join(key, p, mode, max_new_tokens, sampling, reuse)  # noqa: E731
        try:
            for key, outcome in run_all(self.batch(), iter(keys.items()), join):
                if key in self._joined:
                    yield keys[key], self.chunk(key, outcome)
                elif key in keys:  # it could not join
                    yield keys[key], outcome
        finally:
            for key in keys:
                if key in self._joined:
                    self.leave(key)

    def join(
        self,
        key,
        prompt: Prompt,
        mode: str | None = None,
        max_new_tokens: int | None = None,
        sampling: SamplingConfig | None = None,
        reuse: bool = True,
    ) -> None:
        """`prompt`'s generation joins the batch at its next cycle (a free slot needed: `batch().free`), under
        `key`; `chunk` turns its outcomes into chunks. One at a time, the session's per-generation figures start
        afresh."""
        run = self.for_generation(mode, max_new_tokens, sampling)
        ids, chat = self.inputs.prompt_ids(prompt)
        stop = self.tokenizer.stop_ids
        self.batch().join(key, ids, run.max_new_tokens, stop, run.mode, run.tree, run.sampling, reuse)
        self._joined[key] = (prompt, run, chat, StreamDecoder(self.tokenizer))
        if self.plan.parallel <= 1:
            self.session.start_generation()

    def chunk(self, key, outcome) -> Chunk | CadenceError:
        """A batch's outcome for `key` as the generation's next chunk (the last with its `Completion`), or the error
        that ended it alone."""
        prompt, run, chat, decoder = self._joined[key]
        if isinstance(outcome, BaseException):
            del self._joined[key]
            if not isinstance(outcome, CadenceError):
                raise outcome
            return outcome
        stop = self.tokenizer.stop_ids
        text = decoder.push([t for t in outcome.tokens if t not in stop])
        done = None
        if outcome.result is not None:
            text += decoder.finish()
            del self._joined[key]
            done = self._completion(prompt, run, chat, outcome.result, decoder.text())
        return Chunk(text, outcome.tokens, outcome.accepted, outcome.alpha, outcome.finish_reason, done)

    def leave(self, key) -> None:
        """`key`'s generation ends now (a client went away): its slot is free for the next."""
        self._joined.pop(key, None)
        self.batch().leave(key)

    def bound_new_tokens(self, n: int | None) -> None:
        """A generation that asks no number of new tokens (nor does the run) writes at most `n`, fewer where the
        context ends first (`launch run` and `chat`: DEFAULT_NEW_TOKENS); None: to the context's end."""
        self.session.loop.bound = n

    def prepare(self, prompt: Prompt, max_new_tokens: int | None = None) -> Prompt:
        """`prompt` encoded (its ids kept with it) and checked against the context: a PromptError (its `param`
        says what to change) before any generation starts. A server does this as a request arrives."""
        ids, chat = self.inputs.prompt_ids(prompt)
        limits(self.inputs.context, len(ids), max_new_tokens or self.plan.max_new_tokens)
        return dataclasses.replace(prompt, ids=tuple(ids), chat=chat)

    def for_generation(self, mode: str | None, max_new_tokens: int | None, sampling: SamplingConfig | None) -> RunPlan:
        """The run's plan for one generation: `mode` (another of the modes the loaded models run),
        `max_new_tokens` and `sampling` in place of the run's."""
        run = self.plan
        if mode and mode != run.mode:
            mode = Mode(mode)
            if mode.speculative and not run.speculative:
                raise CadenceError(f"mode {mode} needs a draft model, which a {run.mode} run did not load")
            if self.session.streamer is not None and (mode is Mode.STD) != (run.mode is Mode.STD):
                self.session.streamer.prefetch = mode is not Mode.STD
            run = run.with_mode(mode)
        return run.for_generation(max_new_tokens, sampling)

    def _learn(self, gen) -> None:
        """A tree generation's figures added to the run's; kept (engine/acceptance.py) as the run closes, and on a
        long run (a server's) every FLUSH forwards."""
        self._measured = self._measured.add(gen.stats, len(gen.new_ids) - 1)  # the first token: the prompt's
        if self._measured.forwards >= acceptance.FLUSH:
            acceptance.record(
                acceptance.of_plan(self.plan), self._measured, ended=False, alone=acceptance.alone_of(self.plan)
            )
            self._measured = acceptance.Acceptance()

    def _dense_cpu(self, run: RunPlan, d) -> bool:
        """A generation (its plan, its draft or None) whose forwards are the calibration's: one at a time, the target's
        whole layers on the CPU (not a batch's, a sparse FFN's, a mixture's few experts or a GPU's), for
        engine/costs.py `refresh_compute`."""
        return (
            self.plan.parallel <= 1
            and run.device == "cpu"
            and Mode.FLASH not in (run.mode, self.plan.mode)
            and not (d and d.kind is DraftKind.FLASH)
            and not self.plan.target.args.moe
        )

    def _completion(self, prompt: Prompt, run: RunPlan, chat: bool, gen, text: str) -> Completion:
        stop = self.tokenizer.stop_ids
        finish = "stop" if gen.new_ids and gen.new_ids[-1] in stop else "length"
        d = run.draft if run.speculative else None
        if run.mode is Mode.TREE and d.kind is not DraftKind.FLASH:
            self._learn(gen)
        if self._dense_cpu(run, d):
            self._forwards.add(gen.stats, len(gen.new_ids), gen.wall_s - gen.prefill_s)  # whole forwards of all rows
        row = make_row(
            id=prompt.id,
            kind=prompt.kind,
            mode=str(run.mode),
            target=run.target_name,
            draft="flash" if d and d.kind == "flash" else d.name if d else None,
            format=run.format,
            chat=chat,
            prompt_token_ids=gen.prompt_ids,
            new_token_ids=gen.new_ids,
            text=text,
            wall_s=gen.wall_s,
            prefill_s=gen.prefill_s,
            peak_rss_bytes=peak_rss_bytes(self.actor_peaks()),
            stats=gen.stats,
            runtime=str(run.runtime),
            finish_reason=finish,
            **self._plan_fields(),
            **self.session.fields(len(gen.new_ids)),
        )
        return Completion(text, gen.new_ids, finish, len(gen.prompt_ids), row["tokens_per_s"], gen.stats, row)

    def _plan_fields(self) -> dict:
        p = self.plan.memory
        if p is None:
            return {}
        out = {
            "memory_budget_bytes": p.budget,
            "memory_plan": {
                "total_bytes": p.total,
                "held_bytes": p.held,
                "resident_groups": len(p.resident),
                "streamed_groups": len(p.streamed),
                "slots": p.n_slots,
                "slot_bytes": p.slot_bytes,
                "read_per_forward_bytes": p.read_per_forward,
            },
        }
        if p.experts:
            out["memory_plan"].update(
                expert_buffer_bytes=p.expert_buffer, expert_slots=p.expert_slots, experts=p.experts
            )
            bits = "+bits" if "expert_formats" in self.plan.target.manifest else ""
            out["experts"] = self.plan.experts.label + bits
        return out

    # -- what the run holds -----------------------------------------------------------------------------

    def actor_pids(self) -> list[int]:
        return [a.pid for a in self.sched.actor_status() if a.state != "dead"] if self.sched is not None else []

    def actor_peaks(self) -> int:
        """Sum of the actors' peak resident sets (Linux: VmHWM)."""
        total = 0
        for pid in self.actor_pids():
            try:
                with open(f"/proc/{pid}/status") as f:
                    total += next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmHWM"))
            except (OSError, StopIteration, ValueError):
                pass
        return total

    def held_bytes(self) -> int:
        """What this process, the run's actors and the zygote they fork from hold now (PSS: anonymous and shared
        memory), as the monitor's ledger counts them."""
        from scheduler.ledger import held, rollup

        zygote = self.sched.zygote_pid if self.sched is not None else None
        pids = [os.getpid(), *self.actor_pids(), *([zygote] if zygote else [])]
        return sum(held(r) for pid in pids if (r := rollup(pid)))


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
