"""Load what a mode needs once, then generate prompt after prompt; rows for the JSON contract.

Runtimes: `actors` (the default) runs the verifier and draft as actor processes under the
scheduler (shared-memory tensors, ZeroMQ control, a Chrome trace per run); `inproc` runs the same
algorithms in this process (the reference the tests compare against).
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Callable

import psutil

from cadence.errors import CadenceError
from launch.experts import expert_options
from cadence.settings import SamplingConfig, TreeConfig, check_format
from launch.prompts import Prompt, prompt_ids, use_chat
from launch.results import make_row, peak_rss_bytes
from models import registry
from models.convert import ensure_store
from models.tokenizer import StreamDecoder, TextTokenizer
from scheduler.generation.speculation import MODES

RUNTIMES = ("actors", "inproc")
DRAFT_VOCAB = 32768
TRACE_EVENTS = 16384  # trace events the scheduler holds before it spills them to disk (scheduler/trace.py)


@dataclass(frozen=True)
class RunConfig:
    target: str
    draft: str | None
    fmt: str
    mode: str = "tree"
    max_new_tokens: int = 128
    sampling: SamplingConfig = SamplingConfig()
    tree: TreeConfig = field(default_factory=TreeConfig)
    chat: str = "auto"
    device: str = "cpu"
    runtime: str = "actors"
    threads: int = 0
    trace_dir: str | None = None
    trace: bool = True  # write a Chrome trace of the run (--no-trace: none)
    memory_budget: str | None = None  # "3GiB", "auto", or None (no limit: everything resident)
    sparse_worker: bool = False  # split tree attention with the sparse-attention actor (Ghidorah)
    worker_share: float = 0.0  # the share of the dense attention chunks the worker takes too
    column_share: float = 0.0  # the share of each target linear layer's output columns the worker computes
    # FR-Spec: the draft's head keeps only this many (most frequent) token rows under a memory budget;
    # None: DRAFT_VOCAB under a budget, the whole vocabulary without one; 0: the whole vocabulary
    draft_vocab: int | None = None
    draft_fmt: str | None = None  # the draft's weight format (None: the target's), e.g. an int4 draft for a bf16 target
    plan_sampling: bool = False  # plan room for sampling even if the run's default is greedy (a server's requests may sample)
    plan_context: int | None = None  # prompt tokens the memory plan leaves KV room for (None: the longest prompt given, else 1024)
    # a mixture of experts under a budget (scheduler/generation/experts.py): how its expert buffer is kept
    expert_eviction: str = "lru"  # lru | edgemoe | none (loading on demand, no buffer)
    expert_preload: str = "none"  # none | paths (EdgeMoE's path statistics) | router (next-router lookahead)
    expert_preload_k: int = 2  # experts preloaded per layer

    @property
    def draft_model(self) -> str | None:
        """The draft model this run loads: None in target-only modes and with --draft none (or an
        `auto` draft not resolved yet: `pick_draft`)."""
        return self.draft if self.mode in ("chain", "tree") and self.draft not in ("none", "auto") else None

    def __post_init__(self):
        if self.mode not in MODES:
            raise CadenceError(f"mode '{self.mode}' is not known; use one of {', '.join(MODES)}")
        if self.runtime not in RUNTIMES:
            raise CadenceError(f"runtime '{self.runtime}' is not known; use one of {', '.join(RUNTIMES)}")
        if self.max_new_tokens < 1:
            raise CadenceError(f"--max-new-tokens={self.max_new_tokens} must be at least 1")
        if self.chat not in ("auto", "on", "off"):
            raise CadenceError(f"--chat={self.chat} must be auto, on or off")
        if self.mode in ("chain", "tree") and not self.draft:
            raise CadenceError(f"mode {self.mode} needs a draft model: give --draft (or --draft none for tree mode)")
        if self.draft == "none" and self.mode == "chain":
            raise CadenceError("mode chain needs a draft model; with --draft none use --mode tree (the n-gram trie proposes)")
        if self.draft == "none" and self.mode == "tree" and self.runtime != "actors":
            raise CadenceError("--draft none runs over the actor runtime; drop --runtime inproc")
        if self.draft_fmt is not None:
            check_format(self.draft_fmt)
        if self.runtime == "actors" and self.device != "cpu":
            raise CadenceError("the actor runtime runs on the CPU for now; use --runtime inproc with --device cuda")
        if self.mode in ("std", "stdpl") and not self.memory_budget:
            raise CadenceError(f"mode {self.mode} streams the target under a memory budget: give --memory-budget (e.g. auto)")
        if self.memory_budget and self.runtime != "actors":
            raise CadenceError("--memory-budget needs the actor runtime (the I/O loader is an actor); drop --runtime inproc")
        if not 0.0 <= self.worker_share < 1.0 or not 0.0 <= self.column_share < 1.0:
            raise CadenceError(f"--worker-share and --column-share are shares in [0, 1); got {self.worker_share} and {self.column_share}")
        if self.column_share > 0 and not self.sparse_worker:
            raise CadenceError("--column-share gives columns to the sparse-attention worker; add --sparse-worker")
        if self.column_share > 0 and self.memory_budget:
            raise CadenceError("--column-share needs every target layer resident (the worker maps the target's weights "
                               "itself); drop --memory-budget or --column-share")
        if self.draft_vocab is not None and self.draft_vocab < 0:
            raise CadenceError(f"--draft-vocab={self.draft_vocab} must be 0 (the whole vocabulary) or a number of tokens")
        if self.memory_budget and self.mode == "target":
            raise CadenceError("mode target keeps the whole target in memory; under --memory-budget use std, stdpl, chain or tree")


class Runner:
    """Use as a context manager: the actor runtime has processes and shared memory to release."""

    def __init__(self, cfg: RunConfig, prompts: list[Prompt] | None = None):
        """`prompts`: what will be run, if known; the memory plan then sizes the KV caches to the longest."""
        self.cfg = cfg
        self.sched = None
        self.trace_path = None
        # Convert (once), with progress bars, before any actor starts.
        self.target_store = target_store = ensure_store(cfg.target, cfg.fmt)
        if cfg.draft == "auto":
            self.cfg = cfg = RunConfig(**{**cfg.__dict__, "draft": pick_draft(cfg, target_store)})
        speculative = cfg.draft_model is not None
        draft_store = ensure_store(cfg.draft, cfg.draft_fmt or cfg.fmt) if speculative else None
        if speculative and draft_store.tokenizer_info.tokenizer_json != target_store.tokenizer_info.tokenizer_json:
            raise CadenceError(f"the draft {cfg.draft} and the target {cfg.target} have different tokenizers; "
                               "speculative modes need a draft that shares the target's vocabulary")
        self.tokenizer = TextTokenizer(target_store.tokenizer_info)
        self._encoded = {self._key(p): prompt_ids(self.tokenizer, p, cfg.chat) for p in prompts or ()}
        if cfg.plan_context is None:
            longest = max((len(ids) for ids, _ in self._encoded.values()), default=1024)
            self.cfg = cfg = RunConfig(**{**cfg.__dict__, "plan_context": longest})
        if cfg.memory_budget and prompts:
            # every prompt is encoded: decode from a table of token bytes and give the tokenizer's pages
            # (~45 MiB) to the target, before the plan measures this process
            self.tokenizer.release_encoder()
        self.plan = None
        if cfg.runtime == "inproc":
            from models import engine

            self.target = engine.load_store(target_store, cfg.target, cfg.device)
            self.draft = engine.load_store(draft_store, cfg.draft, cfg.device) if speculative else None
            return
        from scheduler.config import MemoryConfig, PipelineConfig, RuntimeConfig, TraceConfig
        from scheduler.runtime import Scheduler
        from scheduler.generation.speculation import ActorSpeculation

        # a mixture of experts' path profile is read before the plan measures this process
        self.experts = expert_options(cfg, target_store)  # launch/experts.py
        self.plan = memory_plan(cfg, target_store, draft_store) if cfg.memory_budget else None
        # the model actors fork from one zygote that imported torch and the model code once (the modules
        # whose cost scheduler/generation/footprint.py measured)
        from scheduler.generation.footprint import ACTOR_MODULES

        preload = (*ACTOR_MODULES, *(("actors.sparse",) if cfg.sparse_worker else ()))
        if self.plan is not None:
            p = self.plan
            o = p.overheads
            roles = {**({"draft": p.draft_weights + p.draft_kv + o.actor + o.draft_activations} if p.has_draft else {}),
                     "verifier": p.resident_bytes + p.target_kv + o.actor + o.verifier_activations,
                     "scheduler": o.scheduler + o.watchdog + o.runtime + o.code, **({"loader": o.actor} if p.streamed or p.expert_buffer else {})}
            mem = MemoryConfig(budget_bytes=p.budget, arena_bytes=p.arena_bytes, stream_bytes=p.stream_bytes,
                               expert_bytes=p.expert_buffer, role_bytes=roles)
            rt = RuntimeConfig(memory=mem, pipeline=PipelineConfig(layer_bytes=p.slot_bytes or (1 << 20)),
                               trace=TraceConfig(enabled=cfg.trace, dir=cfg.trace_dir, spill_events=TRACE_EVENTS),
                               preload=preload)
        else:
            extra = (256 << 20) if cfg.sparse_worker else 0  # the KV cache moves into the arena
            rt = RuntimeConfig(memory=MemoryConfig(budget_bytes=psutil.virtual_memory().total, arena_bytes=(64 << 20) + extra),
                               trace=TraceConfig(enabled=cfg.trace, dir=cfg.trace_dir), preload=preload)
        self.sched = Scheduler(rt).__enter__()
        try:
            self.spec = ActorSpeculation(self.sched, cfg.mode, str(target_store.dir),
                                         str(draft_store.dir) if draft_store else None, cfg.sampling, cfg.tree,
                                         cfg.threads or os.cpu_count() or 1, target_store.args.context_length,
                                         target_store.args.vocab_size, plan=self.plan,
                                         worker={"share": cfg.worker_share, "columns": cfg.column_share} if cfg.sparse_worker else None,
                                         model_args=target_store.args.to_dict(),
                                         draft_vocab=draft_rows(cfg, draft_store) if self.plan is not None else 0,
                                         kv_context=cfg.plan_context if not prompts else None,
                                         experts=self.experts)
        except BaseException:
            self.close()
            raise

    def _key(self, prompt: Prompt) -> tuple:
        return prompt.text, use_chat(prompt, self.cfg.chat)

    def prompt_ids(self, prompt: Prompt) -> tuple[list[int], bool]:
        """The prompt's token ids (after the chat template, if it gets one) and whether it got one."""
        return self._encoded.get(self._key(prompt)) or prompt_ids(self.tokenizer, prompt, self.cfg.chat)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        if self.sched is not None:
            sched, self.sched = self.sched, None
            try:
                if getattr(self, "spec", None) is not None:
                    self.spec.close()
            finally:
                sched.shutdown()
                self.trace_path = sched.trace_path

    def run(self, prompt: Prompt, on_text: Callable[[str], None] | None = None, mode: str | None = None,
            on_cycle: Callable | None = None, **kw) -> dict:
        """Generate for one prompt; `mode` overrides the run's (target / chain / tree, same models);
        `on_text(piece)` as text is committed; `on_cycle(n_new, accepted, alpha)` after each speculation
        cycle (the monitor). Returns the JSON row."""
        steps = self.stream(prompt, mode, on_cycle, **kw)
        while True:
            try:
                piece = next(steps)
            except StopIteration as done:
                return done.value
            if on_text and piece:
                on_text(piece)

    def stream(self, prompt: Prompt, mode: str | None = None, on_cycle: Callable | None = None,
               max_new_tokens: int | None = None, sampling: SamplingConfig | None = None):
        """`run` as a generator of text pieces (stop tokens are never part of the text); returns the row.
        A consumer may stop early between pieces (a client that went away): each piece ends a cycle, where
        the models agree with the text, and the next generation starts afresh. `max_new_tokens` and
        `sampling` override the run's for this generation (the actor runtime)."""
        cfg, tok = self.cfg, self.tokenizer
        if mode and mode != cfg.mode:
            if mode in ("chain", "tree") and cfg.mode in ("target", "std", "stdpl"):
                raise CadenceError(f"mode {mode} needs a draft model, which a {cfg.mode} run did not load")
            if self.sched is not None and self.spec.streamer is not None and (mode == "std") != (cfg.mode == "std"):
                self.spec.streamer.prefetch = mode != "std"
            tree = TreeConfig(**{**cfg.tree.__dict__, "mode": "chain" if mode == "chain" else "tree"})
            cfg = RunConfig(**{**cfg.__dict__, "mode": mode, "tree": tree})
        if max_new_tokens is not None or sampling is not None:
            cfg = RunConfig(**{**cfg.__dict__, "max_new_tokens": max_new_tokens or cfg.max_new_tokens,
                               "sampling": sampling or cfg.sampling})
        ids, chat = self.prompt_ids(prompt)
        decoder = StreamDecoder(tok)
        if self.plan is not None and len(ids) > self.cfg.plan_context:
            raise CadenceError(f"the prompt has {len(ids)} tokens but the memory plan left KV cache room for "
                               f"{self.cfg.plan_context}; give --context {len(ids)} (or more)")
        if self.sched is not None:
            n_ctx = self.spec.context_length
            if len(ids) + cfg.max_new_tokens > n_ctx:  # same sentence as the in-process path
                raise CadenceError(f"the prompt has {len(ids)} tokens and {cfg.max_new_tokens} new tokens were asked for, "
                                   f"but the model's context holds {n_ctx}; shorten the prompt or lower --max-new-tokens")
            steps = self.spec.stream(ids, cfg.max_new_tokens, tok.stop_ids, cfg.mode, cfg.tree, cfg.sampling)
            while True:
                try:
                    new, accepted, alpha = next(steps)
                except StopIteration as done:
                    gen = done.value
                    break
                if on_cycle:
                    on_cycle(len(new), accepted, alpha)
                yield decoder.push([t for t in new if t not in tok.stop_ids])
            extra = _actor_peaks(self.sched)
        else:  # in process: the reference runtime generates to the end, then hands its text over
            pieces = []
            on_tokens = lambda new: pieces.append(decoder.push([t for t in new if t not in tok.stop_ids]))
            if cfg.mode in ("target", "std", "stdpl"):
                from speculative.generate import generate_target

                gen = generate_target(self.target, ids, cfg.max_new_tokens, cfg.sampling, on_tokens)
            else:
                tree = cfg.tree if cfg.tree.mode == cfg.mode else TreeConfig(**{**cfg.tree.__dict__, "mode": cfg.mode})
                from speculative.generate import generate_speculative

                gen = generate_speculative(self.target, self.draft, ids, cfg.max_new_tokens, cfg.sampling, tree, on_tokens)
            yield "".join(pieces)
            extra = 0
        extra_fields = {}
        if self.plan is not None:
            p = self.plan
            extra_fields = {"memory_budget_bytes": p.budget,
                            "memory_plan": {"total_bytes": p.total, "held_bytes": p.held, "resident_groups": len(p.resident),
                                            "streamed_groups": len(p.streamed), "slots": p.n_slots, "slot_bytes": p.slot_bytes,
                                            "read_per_forward_bytes": p.read_per_forward}}
            if p.experts:
                extra_fields["memory_plan"].update(expert_buffer_bytes=p.expert_buffer, expert_slots=p.expert_slots,
                                                   experts=p.experts)
                bits = "+bits" if "expert_formats" in self.target_store.manifest else ""
                extra_fields["experts"] = f"{cfg.expert_eviction}+{cfg.expert_preload}{bits}"
        text_ids = gen.new_ids[:-1] if gen.new_ids and gen.new_ids[-1] in tok.stop_ids else gen.new_ids
        return make_row(id=prompt.id, kind=prompt.kind, mode=cfg.mode, target=cfg.target,
                        draft=cfg.draft_model, format=cfg.fmt, chat=chat,
                        prompt_token_ids=ids, new_token_ids=gen.new_ids, text=tok.decode(text_ids),
                        wall_s=gen.wall_s, prefill_s=gen.prefill_s, peak_rss_bytes=peak_rss_bytes(extra),
                        stats=gen.stats, runtime=cfg.runtime, **extra_fields)


def pick_draft(cfg: RunConfig, target_store, say: Callable[[str], None] | None = None) -> str:
    """The draft for `--draft auto`: the default draft if it shares the target's tokenizer and is the
    smaller model, else another pulled default model that does, else "none" (the n-gram trie alone).
    Says which in one line when it is not the default."""
    from models.pull import is_pulled

    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    if cfg.mode not in ("chain", "tree"):
        return "auto"
    target_bytes = target_store.manifest["file_bytes"]
    names = [registry.DEFAULT_DRAFT, *(n for n in registry.MODELS if n != registry.DEFAULT_DRAFT)]
    for name in names:
        if name == cfg.target or (name != registry.DEFAULT_DRAFT and not is_pulled(registry.spec(name))):
            continue
        store = ensure_store(name, cfg.draft_fmt or cfg.fmt)
        if store.manifest["file_bytes"] < target_bytes and \
                store.tokenizer_info.tokenizer_json == target_store.tokenizer_info.tokenizer_json:
            if name != registry.DEFAULT_DRAFT:
                say(f"draft: {name} (the default draft {registry.DEFAULT_DRAFT} does not share {cfg.target}'s tokenizer)")
            return name
    if cfg.mode == "chain":
        raise CadenceError(f"no known draft shares {cfg.target}'s tokenizer; give --draft, or use --mode tree "
                           "(with no draft model the n-gram trie proposes)")
    say(f"draft: none ({cfg.target} shares no known draft's tokenizer): the n-gram trie of the prompt and the output proposes")
    return "none"


def kv_capacity(cfg: RunConfig, draft: bool = False) -> int:
    """KV cache rows the plan leaves room for: the longest prompt (the draft: its last `prompt_window`
    tokens), the new tokens, a tree and its slack (scheduler/generation/speculation.py sizes the caches the same way)."""
    prompt = cfg.plan_context or 1024
    if draft and cfg.tree.prompt_window:
        prompt = min(prompt, cfg.tree.prompt_window)
    return prompt + cfg.max_new_tokens + max(cfg.tree.budget, 64) + cfg.tree.ahead + 2


def plan_inputs(cfg: RunConfig, target_store, draft_store, overheads=None) -> dict:
    """What the memory plan of `cfg` weighs: the target's streamable groups, the draft's weights (its
    head cut to the FR-Spec rows), the KV caches at the context the run needs, the overheads."""
    from scheduler.generation.memplan import measure_overheads

    cap = kv_capacity(cfg)
    groups = {g: target_store.groups[g].nbytes for g in target_store.group_names() if g != "embed" and not g.startswith("expert.")}
    experts = {g: target_store.groups[g].nbytes for g in target_store.group_names() if g.startswith("expert.")}
    draft_w = rows = 0
    if draft_store is not None:
        rows = draft_rows(cfg, draft_store)
        draft_w = sum(n for g, n in draft_store.group_bytes().items() if g != "embed" and not g.startswith("head."))
        draft_w += draft_store.head_bytes(rows or None)
    trie = (cfg.plan_context or 1024) + cfg.max_new_tokens
    o = overheads or measure_overheads(
        target_store.args.to_dict(), draft_store.args.to_dict() if draft_store else None, width=cfg.tree.budget,
        context=cfg.plan_context or 1024, greedy=cfg.sampling.greedy and not cfg.plan_sampling,
        draft_window=cfg.tree.prompt_window,
        draft_vocab=rows, trie_nodes=8 * trie if cfg.tree.trie and cfg.mode == "tree" else 0, trace_events=TRACE_EVENTS + 2048)  # the sink's and the scheduler's own, before they move on
    return {"target_groups": groups, "draft_weights": draft_w,
            "draft_kv": draft_store.args.kv_bytes_per_token() * kv_capacity(cfg, draft=True) if draft_store else 0,
            "target_kv": target_store.args.kv_bytes_per_token() * cap, "overheads": o,
            **({"experts": experts, "experts_used": target_store.args.n_experts_used} if experts else {})}


def memory_plan(cfg: RunConfig, target_store, draft_store, overheads=None):
    """The plan for --memory-budget: KV room for `plan_context` prompt tokens plus the new ones, the
    runtime's overheads as measured on this machine (`overheads` overrides them)."""
    from scheduler.generation.memplan import parse_bytes, plan_memory, smallest_budget

    inputs = plan_inputs(cfg, target_store, draft_store, overheads)
    if cfg.memory_budget == "auto":  # the smallest budget that works and half of the target
        every = sum(inputs["target_groups"].values()) + sum(inputs.get("experts", {}).values())
        budget = smallest_budget(**inputs) + every // 2
    else:
        budget = parse_bytes(cfg.memory_budget)
    return plan_memory(budget, **inputs)


def draft_rows(cfg: RunConfig, draft_store) -> int:
    """Token rows the draft's head keeps (0: all): FR-Spec's frequent-token head under a budget."""
    if draft_store is None:
        return 0
    rows = cfg.draft_vocab if cfg.draft_vocab is not None else (DRAFT_VOCAB if cfg.memory_budget else 0)
    return 0 if rows >= draft_store.args.vocab_size else rows


def _actor_peaks(sched) -> int:
    """Sum of the actors' peak resident sets (Linux: VmHWM)."""
    total = 0
    for st in sched.actor_status():
        try:
            with open(f"/proc/{st.pid}/status") as f:
                total += next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmHWM"))
        except (OSError, StopIteration, ValueError):
            pass
    return total


def print_text(piece: str):
    sys.stdout.write(piece)
    sys.stdout.flush()
