"""The engine of a run, the same for every front door (`launch run`, `chat`, `serve`, `bench`,
`cadence.LLM`): what a configuration needs is resolved and loaded once, then prompt after prompt
streams, a `Chunk` per speculation cycle, the last one with the `Completion`.

    with Runner(RunConfig.from_options(memory_budget="1GiB")) as runner:
        for chunk in runner.stream(Prompt("p", "chat", "What is a mutex?")):
            print(chunk.text, end="")
        row = chunk.completion.row

Runtimes: `actors` (the default) runs the verifier and draft as actor processes under the scheduler
(shared-memory tensors, ZeroMQ control, a Chrome trace per run); `inproc` runs the same cycle in
this process (engine/sessions.py).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Iterator

from common.errors import CadenceError
from common.settings import SamplingConfig
from engine.config import RunConfig
from engine.memory import memory_plan, settle
from engine.prompts import Prompt
from engine.resolve import resolve
from engine.rows import Chunk, Completion, make_row, peak_rss_bytes
from engine.sessions import LocalSession, open_actors
from speculative.loop import limits
from models.tokenizer import StreamDecoder


class Runner:
    """Use as a context manager: the actor runtime has processes and shared memory to release."""

    def __init__(self, cfg: RunConfig, prompts: list[Prompt] | None = None, say: Callable[[str], None] | None = None):
        """`prompts`: what will be run, if known: each is encoded once, and the context sized to the longest.
        `say`: where a line about a choice made (the draft `auto` took) goes; default stderr."""
        self.sched = None
        self.trace_path = None
        self.resolved = r = resolve(cfg, prompts, say)  # converts a model once, with progress bars, before any actor
        self.cfg, self.tokenizer = r.cfg, r.tokenizer
        if self.cfg.memory_budget and prompts:
            # every prompt is encoded: decode from a table of token bytes and give the tokenizer's pages
            # (~45 MiB) to the target, before the plan measures this process
            self.tokenizer.release_encoder()
        if self.cfg.mode == "flash":  # approximate, in this process, its own memory plan (engine/flash.py)
            from engine.flash import FlashSession

            self.plan, self.session = None, FlashSession(r)
            return
        settle(r, say or _stderr)  # under a budget: whether the `auto` draft stays, and the tree's width
        self.cfg = r.cfg
        # a mixture of experts' path profile was read (resolve) before the plan measures this process
        self.plan = memory_plan(self.cfg, r.target, r.draft) if self.cfg.memory_budget else None
        if self.cfg.runtime == "inproc":
            self.session = LocalSession(r)
        else:
            self.sched, self.session = open_actors(r, self.plan)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        if self.sched is None and hasattr(self, "session"):
            self.session.close()
        if self.sched is not None:
            sched, self.sched = self.sched, None
            try:
                self.session.close()
            finally:
                sched.shutdown()
                self.trace_path = sched.trace_path

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
        """The generation for `prompt`, a chunk per cycle (stop tokens are never part of the text). A
        consumer may stop early between chunks (a client that went away): each ends a cycle, where the
        models agree with the text, and the next generation starts afresh. `mode` (another of the modes
        the loaded models run), `max_new_tokens` and `sampling` override the run's for this generation. `reuse` False: the
        whole prompt is prefilled (a benchmark comparing modes on one prompt: each pays its own prefill)."""
        cfg = self.for_generation(mode, max_new_tokens, sampling)
        ids, chat = self.resolved.prompt_ids(prompt)
        tok, stop = self.tokenizer, self.tokenizer.stop_ids
        decoder = StreamDecoder(tok)
        if getattr(self.session, "approximate", False):
            self.session.weights.reset_stats()
        cycles = self.session.loop.stream(ids, cfg.max_new_tokens, stop, cfg.mode, cfg.tree, cfg.sampling, reuse)
        for c in cycles:
            text = decoder.push([t for t in c.tokens if t not in stop])
            done = self._completion(prompt, cfg, chat, c.result, decoder.text()) if c.result else None
            yield Chunk(text, c.tokens, c.accepted, c.alpha, c.finish_reason, done)

    def prepare(self, prompt: Prompt, max_new_tokens: int | None = None) -> Prompt:
        """`prompt` encoded (its ids kept with it) and checked against the context: a PromptError (its `param`
        says what to change) before any generation starts. A server does this as a request arrives."""
        ids, chat = self.resolved.prompt_ids(prompt)
        limits(self.cfg.context, len(ids), max_new_tokens or self.cfg.max_new_tokens)
        return dataclasses.replace(prompt, ids=tuple(ids), chat=chat)

    def for_generation(
        self, mode: str | None, max_new_tokens: int | None, sampling: SamplingConfig | None
    ) -> RunConfig:
        cfg = self.cfg
        if mode and mode != cfg.mode:
            if mode in ("chain", "tree") and not cfg.speculative:
                raise CadenceError(f"mode {mode} needs a draft model, which a {cfg.mode} run did not load")
            if self.session.streamer is not None and (mode == "std") != (cfg.mode == "std"):
                self.session.streamer.prefetch = mode != "std"
            cfg = cfg.with_mode(mode)
        return dataclasses.replace(
            cfg, max_new_tokens=max_new_tokens or cfg.max_new_tokens, sampling=sampling or cfg.sampling
        )

    def _completion(self, prompt: Prompt, cfg: RunConfig, chat: bool, gen, text: str) -> Completion:
        stop = self.tokenizer.stop_ids
        finish = "stop" if gen.new_ids and gen.new_ids[-1] in stop else "length"
        row = make_row(
            id=prompt.id,
            kind=prompt.kind,
            mode=cfg.mode,
            target=cfg.target,
            draft="flash" if cfg.speculative and cfg.draft == "flash" else cfg.draft_model,
            format=cfg.dtype,
            chat=chat,
            prompt_token_ids=gen.prompt_ids,
            new_token_ids=gen.new_ids,
            text=text,
            wall_s=gen.wall_s,
            prefill_s=gen.prefill_s,
            peak_rss_bytes=peak_rss_bytes(self.actor_peaks()),
            stats=gen.stats,
            runtime=cfg.runtime,
            finish_reason=finish,
            **self._plan_fields(),
            **(self.session.fields(len(gen.new_ids)) if getattr(self.session, "approximate", False) else {}),
        )
        return Completion(text, gen.new_ids, finish, len(gen.prompt_ids), row["tokens_per_s"], gen.stats, row)

    def _plan_fields(self) -> dict:
        p = self.plan
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
            bits = "+bits" if "expert_formats" in self.resolved.target.manifest else ""
            out["experts"] = self.cfg.experts.label + bits
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
    import sys

    print(line, file=sys.stderr, flush=True)
