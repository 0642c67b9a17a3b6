"""cadence from Python: a model pair loaded once, text in, text out.

    import cadence

    with cadence.LLM(memory_budget="1GiB") as llm:      # the default target and draft, streamed
        print(llm.generate("def fibonacci(n):", max_new_tokens=48).text)
        for piece in llm.stream("def quicksort(items):"):
            print(piece, end="", flush=True)
        reply = llm.chat([{"role": "user", "content": "What is a mutex?"}])
        print(reply.text, reply.tokens_per_s)

`LLM` starts the runtime (the scheduler in this process, the model actors forked beside it) and
stops it on `close()` or at the end of the `with` block; nothing is left behind either way. One
generation runs at a time. `generate` and `stream` complete raw text; `chat` and `chat_stream`
apply the model's chat template to a conversation. Greedy by default: the output is exactly the
target model's own, whichever mode and budget produced it.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Iterator

from cadence.errors import CadenceError
from cadence.settings import SamplingConfig, TreeConfig

DEFAULT_TARGET = "qwen2.5-coder-1.5b"


@dataclass(frozen=True)
class Completion:
    text: str  # the generated text (a stop token is never part of it)
    token_ids: list[int]  # the generated tokens (a stop token, if one was reached, is the last)
    finish_reason: str  # "stop": a stop token ended it; "length": max_new_tokens did
    prompt_tokens: int
    tokens_per_s: float
    stats: dict = field(default_factory=dict)  # what the mode did: verifications, acceptance, bytes read, ...


class LLM:
    """A target model, its draft and the runtime, loaded once.

    target, draft: a default model's name, a .gguf file or an HF directory; draft "auto" picks a
        draft that shares the target's tokenizer (none: the n-gram trie alone).
    dtype: the weight format (int4, int8, bf16, fp16, fp32); draft_dtype: the draft's, if other.
    mode: tree (default), chain, target; std or stdpl stream the target alone.
    memory_budget: e.g. "1GiB": the whole run stays under it, the target streaming from disk.
    context: prompt tokens the memory plan leaves KV room for (default 1024).
    temperature, top_p, seed: the default sampling (0: greedy); each call may override them.
    trace_dir: write a Chrome trace of the run there (default: none).
    """

    def __init__(self, target: str = DEFAULT_TARGET, draft: str = "auto", *, dtype: str = "int4",
                 draft_dtype: str | None = None, mode: str = "tree", memory_budget: str | None = None,
                 context: int | None = None, max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int = 0, threads: int = 0, trace_dir: str | None = None, tree: TreeConfig | None = None):
        from launch.runner import RunConfig, Runner

        if tree is None:
            tree = TreeConfig(mode="chain" if mode == "chain" else "tree", ahead=4, ahead_auto=True)
        cfg = RunConfig(target=target, draft=draft, fmt=dtype, draft_fmt=draft_dtype, mode=mode,
                        max_new_tokens=max_new_tokens, sampling=SamplingConfig(temperature, top_p, seed), tree=tree,
                        threads=threads, trace_dir=trace_dir, trace=trace_dir is not None, memory_budget=memory_budget,
                        plan_context=context, plan_sampling=True)
        self._runner = Runner(cfg)
        self.tokenizer = self._runner.tokenizer
        self.plan = self._runner.plan  # the memory plan, under a budget
        self._ids = itertools.count()

    @property
    def config(self):
        return self._runner.cfg

    def generate(self, prompt: str, **kw) -> Completion:
        """Complete `prompt` (raw text, no chat template). kw: max_new_tokens, temperature, top_p, seed."""
        return self._collect(self.stream(prompt, **kw))

    def stream(self, prompt: str, **kw) -> Iterator[str]:
        """`generate` as text pieces, as the model commits them; the Completion is the generator's
        return value (and `last`). Stop iterating early and the generation stops at once."""
        from launch.prompts import Prompt

        return self._stream(Prompt(f"api-{next(self._ids)}", "complete", prompt, chat=False), **kw)

    def chat(self, messages: list[dict], **kw) -> Completion:
        """Answer a conversation ({"role": "system"|"user"|"assistant", "content": ...} dicts, the
        last one the user's) through the model's chat template."""
        return self._collect(self.chat_stream(messages, **kw))

    def chat_stream(self, messages: list[dict], **kw) -> Iterator[str]:
        from launch.prompts import Prompt

        if not messages or not all(isinstance(m, dict) and isinstance(m.get("content"), str) and m.get("role")
                                   for m in messages):
            raise CadenceError('messages must be a non-empty list of {"role": ..., "content": "..."} dicts')
        return self._stream(Prompt(f"api-{next(self._ids)}", "chat", "", chat=True, messages=tuple(messages)), **kw)

    def _stream(self, prompt, max_new_tokens: int | None = None, temperature: float | None = None,
                top_p: float | None = None, seed: int | None = None):
        base = self.config.sampling
        sampling = SamplingConfig(base.temperature if temperature is None else temperature,
                                  base.top_p if top_p is None else top_p, base.seed if seed is None else seed)
        row = yield from self._runner.stream(prompt, max_new_tokens=max_new_tokens, sampling=sampling)
        self.last = completion(row, self.tokenizer.stop_ids)
        return self.last

    @staticmethod
    def _collect(steps) -> Completion:
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    def close(self) -> None:
        """Stop the actors and free the shared memory (also at the end of a `with` block)."""
        self._runner.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def completion(row: dict, stop_ids: set[int]) -> Completion:
    ids = row["new_token_ids"]
    return Completion(text=row["text"], token_ids=ids, finish_reason="stop" if ids and ids[-1] in stop_ids else "length",
                      prompt_tokens=len(row["prompt_token_ids"]), tokens_per_s=row["tokens_per_s"], stats=row["stats"])
