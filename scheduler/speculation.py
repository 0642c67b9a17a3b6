"""Speculative generation through the actors: the scheduler side of `target`, `chain` and `tree`.

The draft actor grows a tree, the verifier actor scores it in one pass and says which path it
accepts, the draft keeps that path; the governor (speculative/governor.py) picks each cycle's
budget from the throughput it measures. Only token ids and small tree descriptions travel over
the control socket; sampling distributions travel through the shared-memory arena.
"""
from __future__ import annotations

import time
from dataclasses import asdict
from typing import Callable

from cadence.settings import LOOKUP, Generation, SamplingConfig, SpecStats, TreeConfig, budgets
from scheduler.errors import ActorError
from scheduler.runtime import Scheduler
from scheduler.target import ActorTarget
from speculative.governor import Governor
from speculative.lookup import PromptLookup

MODES = ("target", "std", "stdpl", "chain", "tree")
TARGET_ONLY = ("target", "std", "stdpl")  # std, stdpl: the target alone, streamed (without / with prefetch)


class ActorSpeculation:
    def __init__(self, sched: Scheduler, mode: str, target_store: str, draft_store: str | None,
                 sampling: SamplingConfig, cfg: TreeConfig, threads: int, context_length: int, vocab_size: int,
                 plan=None, loader: dict | None = None, worker: dict | None = None, model_args: dict | None = None,
                 draft_vocab: int = 0, kv_context: int | None = None):
        """`plan` (scheduler/memplan.py): stream the target's groups it does not keep resident.
        `worker` ({"share": s, "columns": c}): split tree attention with the sparse-attention actor, which
        also takes the share s of the dense chunks and, with c > 0, the last share c of every target
        linear layer's output columns in multi-token passes; verifier and worker then run on one core each.
        `draft_vocab` (under a plan): the draft's head keeps only that many token rows (FR-Spec); 0: all.
        `draft_store` None in a speculative mode: no draft model (`--draft none`); the trie of the prompt
        and output n-grams proposes the candidates, here in the scheduler (speculative/lookup.py)."""
        self.s, self.mode, self.sampling, self.cfg = sched, mode, sampling, cfg
        self.base_sampling = sampling  # the run's; a generation may ask for its own
        self.context_length, self.vocab_size = context_length, vocab_size
        # the target's KV cache is sized for prompts this long at least, so that the next prompt that
        # continues the last one (a conversation) finds its prefix in the cache: None sizes it per prompt
        self.kv_context = kv_context
        self.current, self.cur_cfg = mode, cfg  # the mode and tree settings of the generation under way
        self.streamer = None
        self.governors: dict[tuple, Governor] = {}  # per mode and budget set, kept across prompts
        self.lookup = PromptLookup(cfg.width) if mode not in TARGET_ONLY and draft_store is None else None
        self.io_wait: float | None = None  # the verifier's measured share of a verification spent waiting for layers
        common = {"sampling": asdict(sampling), "threads": threads}
        vinit = {**common, "store": target_store}
        if worker is not None:
            vinit.update(threads=1, worker=worker)
            sched.spawn("sparse", "actors.sparse:SparseAttnActor", {"threads": 1, "model": model_args, "store": target_store,
                                                                    "columns": worker.get("columns", 0.0)}, wait=False)
        if plan is not None and plan.streamed:
            vinit["resident"] = list(plan.resident)
            sched.spawn("loader", "actors.loader:LoaderActor", {"store_dir": target_store, "stream_bytes": plan.stream_bytes,
                                                                 **(loader or {})}, wait=False)
        sched.spawn("verifier", "actors.verifier:VerifierActor", vinit, wait=False)
        if mode not in TARGET_ONLY and draft_store is not None:
            sched.spawn("draft", "actors.draft:DraftActor", {**common, "store": draft_store, "tree": asdict(cfg),
                                                            "embed_on_disk": plan is not None,
                                                            "head_rows": draft_vocab or None}, wait=False)
        sched.wait_ready()
        if "loader" in sched.actors:
            from scheduler.streaming import Streamer

            sizes = sched.call("loader", "groups").result["groups"]
            self.streamer = Streamer(sched, list(plan.streamed), {g: sizes[g] for g in plan.streamed}, prefetch=mode != "std")
        self.target = ActorTarget(sched, self.streamer, worker, model_args, cfg)

    def close(self):
        if self.streamer is not None:
            self.streamer.drain()
        self.target.close()

    AHEAD_WAIT = 0.2  # draft ahead while the verifier waits on I/O for more than this share of a verification

    def _ahead_steps(self) -> int:
        """Draft forwards the draft may run during this verification (LLMCad's speculative drafting).
        Two cores cannot draft and verify at once for free: with `ahead_auto` the draft drafts ahead
        only while the verifier spends more than AHEAD_WAIT of its verifications waiting for layers
        (measured, a moving average), when a core would idle otherwise."""
        c = self.cur_cfg
        if not c.ahead_auto:
            return c.ahead
        if self.streamer is None:
            return 0
        return c.ahead if self.io_wait is None or self.io_wait > self.AHEAD_WAIT else 0

    def _capacity(self, n_prompt: int, max_new: int, cfg: TreeConfig | None = None) -> int:
        """KV rows for a prompt and its continuation, a tree and its slack; the draft (`cfg` given) sees
        only the prompt's last `prompt_window` tokens (launch/runner.py plans the same)."""
        c = cfg or self.cfg
        if cfg is not None and cfg.prompt_window:
            n_prompt = min(n_prompt, cfg.prompt_window)
        elif cfg is None and self.kv_context:
            n_prompt = max(n_prompt, self.kv_context)
        return min(self.context_length, n_prompt + max_new + max(c.budget, 64) + c.ahead + 2)

    def generate(self, prompt_ids: list[int], max_new: int, stop: set[int],
                 on_tokens: Callable[[list[int]], None] | None = None, mode: str | None = None,
                 cfg: TreeConfig | None = None, on_cycle: Callable | None = None,
                 sampling: SamplingConfig | None = None) -> Generation:
        """`stream` to its end: `on_tokens(new_ids)` as tokens are committed; `on_cycle(n_new, accepted,
        alpha)` after each cycle (accepted and alpha are None for a plain target step): the monitor's feed."""
        steps = self.stream(prompt_ids, max_new, stop, mode, cfg, sampling)
        while True:
            try:
                new, accepted, alpha = next(steps)
            except StopIteration as done:
                return done.value
            if on_tokens:
                on_tokens(new)
            if on_cycle:
                on_cycle(len(new), accepted, alpha)

    def stream(self, prompt_ids: list[int], max_new: int, stop: set[int], mode: str | None = None,
               cfg: TreeConfig | None = None, sampling: SamplingConfig | None = None):
        """Generate with this run's mode, or another one (`target` always; `chain`/`tree` need the draft),
        and this run's sampling or another. A generator: after the prefill and after each cycle it yields
        (the tokens committed, accepted draft tokens, alpha) (None, None for a plain step) and it returns
        the Generation. Each yield is a cycle boundary, where both models' caches agree with the text: a
        consumer may stop there (a client that went away), and the next generation starts afresh."""
        s = self.s
        mode, cfg = mode or self.mode, cfg or self.cfg
        if mode not in TARGET_ONLY and "draft" not in s.actors and self.lookup is None:
            raise ValueError(f"mode {mode} needs the draft actor, which this run did not start")
        if mode == "chain" and "draft" not in s.actors:
            raise ValueError("mode chain needs a draft model; --draft none speculates in tree mode only")
        self.current, self.cur_cfg = mode, cfg
        self.sampling = sampling or self.base_sampling
        wire_sampling = asdict(self.sampling)
        cap = self._capacity(len(prompt_ids), max_new)
        t0 = time.perf_counter()
        started = self.target.run("start", {"prompt_ids": prompt_ids, "capacity": cap, "sampling": wire_sampling})
        first = started["token"]
        speculative = mode not in TARGET_ONLY
        if speculative and self.lookup is not None:
            self.lookup.start(prompt_ids, [first])
        elif speculative:
            s.call("draft", "start", {"prompt_ids": prompt_ids, "capacity": self._capacity(len(prompt_ids), max_new, cfg),
                                      "first": [first], "tree": asdict(cfg), "sampling": wire_sampling})
        t_prefill = time.perf_counter() - t0
        governor = None
        arms = (LOOKUP, 0) if self.lookup is not None else budgets(cfg)  # no draft: the trie or a plain step
        if speculative and (cfg.adaptive or self.lookup is not None):  # what speculation earned on earlier prompts carries over
            key = (mode, arms)
            governor = self.governors.setdefault(key, Governor(arms, LOOKUP if self.lookup is not None else cfg.budget))
            governor.new_text()
        stats = SpecStats()
        out = [first]
        self.last_cycle = None
        yield [first], None, None
        while len(out) < max_new and out[-1] not in stop:
            remaining = max_new - len(out)
            budget = 0 if not speculative else min(governor.choose() if governor else cfg.budget, remaining - 1)
            stats.budget_hist[budget] = stats.budget_hist.get(budget, 0) + 1
            t_cycle = time.perf_counter()
            new = self._cycle(budget, out[-1], stats)
            now = time.perf_counter()
            if governor:
                governor.record(budget, len(new), now - t_cycle)
            for i, tok in enumerate(new):
                if tok in stop or len(out) + i + 1 >= max_new:
                    new = new[:i + 1]
                    break
            out.extend(new)
            s.tracer.counter("tokens", {"total": len(out)})
            accepted, alpha = self.last_cycle or (None, None)
            yield new, accepted, alpha
        st = stats.as_dict() if speculative else {"target_forwards": stats.target_forwards}
        st["reused_prompt_tokens"] = started.get("reused", 0)  # found in the KV cache from the last generation
        if self.streamer is not None:
            st.update(self.streamer.stats.as_dict())
            self.streamer.stats = type(self.streamer.stats)()
        return Generation(prompt_ids, out[:max_new], time.perf_counter() - t0, t_prefill, st)

    def _cycle(self, budget: int, root: int, stats: SpecStats) -> list[int]:
        """One draft-verify cycle (budget 0: a plain target step; LOOKUP: the trie's candidates verified,
        no draft forward); returns the committed tokens."""
        s = self.s
        stats.target_forwards += 1
        tree = None
        slot = build_req = None
        if budget > 0:
            t = time.perf_counter()
            tensors = {}
            if not self.sampling.greedy:  # room for the draft's distributions, one row per fed node
                slot = s.slots.alloc((budget + 1) * self.vocab_size * 4)
                tensors = {"slot": s.slot_desc(slot)}
            reply = s.call("draft", "build", {"budget": budget}, tensors)
            tree, tree_tensors = reply.result, reply.tensors
            build_req = reply.req_id
            stats.draft_s += time.perf_counter() - t
            if not tree["tokens"]:
                tree = None
        elif budget == LOOKUP and self.lookup is not None:  # no draft model: the trie here
            tree, tree_tensors = self.lookup.tree(self.cur_cfg.width), {}
            if tree is not None and self.sampling.greedy:
                tree.pop("trials")
        elif budget == LOOKUP:  # prompt lookup: the trie's candidates, no draft forward
            tree, tree_tensors = s.call("draft", "lookup", {"max_nodes": self.cur_cfg.width}).result, {}
            if not tree["tokens"]:
                tree = None
        t = time.perf_counter()
        try:
            if tree is None:
                nxt = self.target.run("step", {"root": root})["token"]
                stats.plain_steps += 1
                if self.lookup is not None:
                    self.lookup.push([nxt])
                elif self.current not in TARGET_ONLY:
                    s.call("draft", "advance", {"path": [], "new": [nxt], "tree": budget > 0})
                stats.verify_s += time.perf_counter() - t
                self.last_cycle = None
                return [nxt]
            ahead_req = None
            if cfg_ahead := (self._ahead_steps() if self.sampling.greedy and budget > 0 else 0):
                # the draft drafts on while the target verifies; the verdict (advance) interrupts it
                ahead_req = s.send("draft", "ahead", {"steps": cfg_ahead})
            verify_req = s._next_req
            wait0, t_verify = self.streamer.stats.wait_s if self.streamer else 0.0, time.perf_counter()
            v = self.target.run("verify", tree, tree_tensors)
            if self.streamer is not None:  # the share of a verification spent waiting for the loader
                share = (self.streamer.stats.wait_s - wait0) / max(time.perf_counter() - t_verify, 1e-9)
                self.io_wait = share if self.io_wait is None else 0.7 * self.io_wait + 0.3 * share
        finally:
            if slot is not None:
                s.slots.free(slot)
        path = list(v["path"])
        new = [tree["tokens"][i] for i in path] + [v["next"]]
        if self.lookup is not None:
            self.lookup.push(new)
            adv, alpha = {}, None
        else:
            adv = s.call("draft", "advance", {"path": path, "new": new, "tree": budget > 0}).result
            alpha = adv["alpha"]
        if ahead_req is not None:  # answered before `advance` (one socket, in order), unless a stream poll took it
            r = s.take_reply(ahead_req)
            if r is not None and not r.ok:
                raise ActorError("draft", "ahead", ahead_req, r.error)
        stats.ahead_steps, stats.ahead_reused = adv.get("ahead_steps", 0), adv.get("ahead_reused", 0)
        stats.verify_s += time.perf_counter() - t
        stats.verifications += 1
        stats.accepted += len(path)
        stats.drafted += len(tree["tokens"])
        stats.trie_drafted += tree["trie_nodes"]
        stats.draft_forwards += tree["forwards"]
        stats.accepted_hist[len(path)] = stats.accepted_hist.get(len(path), 0) + 1
        self.last_cycle = (len(path), alpha)
        s.tracer.counter("accepted", {"length": len(path), "tree": len(tree["tokens"])})
        if alpha is not None:
            stats.alpha.append(alpha)
            s.tracer.counter("alpha", {"alpha": alpha})
        if build_req is not None:  # the arrow from the draft's tree to its verification
            s.trace.link((s.actors["draft"].pid, build_req), (s.actors["verifier"].pid, verify_req), "draft tree", "tree")
        return new
