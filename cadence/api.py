"""cadence from Python: a model pair loaded once, text in, text out.

    import cadence

    with cadence.LLM(memory_budget="1GiB") as llm:      # the default target and draft, streamed
        print(llm.generate("def fibonacci(n):", max_new_tokens=48).text)
        for chunk in llm.stream("def quicksort(items):"):
            print(chunk.text, end="", flush=True)
        reply = llm.chat([{"role": "user", "content": "What is a mutex?"}])
        print(reply.text, reply.tokens_per_s)

`LLM(**options)` takes the options `launch run` takes, by the same names (engine/options.py:
`--max-new-tokens 64` is `max_new_tokens=64`), or `LLM.from_config(cfg)` a `RunConfig`. It starts the
runtime (the scheduler in this process, the model actors forked beside it) and stops it on `close()`
or at the end of the `with` block; nothing is left behind either way. One generation runs at a time.
`generate` and `stream` complete raw text; `chat` and `chat_stream` apply the model's chat template to
a conversation. Greedy by default: the output is exactly the target model's own, whichever mode and
budget produced it. A generation runs until the model ends its turn or the context is full, unless
`max_new_tokens` says less.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Iterator

from common.errors import CadenceError
from common.settings import SAMPLING_FIELDS, SamplingConfig
from speculative.grammar import grammar_of
from engine.config import RunConfig
from engine.prompts import Prompt
from engine.rows import Chunk, Completion
from engine.runner import Runner

__all__ = ["LLM", "Chunk", "Completion", "RunConfig"]


class LLM:
    """A target model, its draft and the runtime, loaded once."""

    def __init__(self, config: RunConfig | None = None, **options):
        """`LLM(**options)`, or `LLM(cfg)` (`LLM.from_config(cfg)`) with a configuration made already."""
        if config is not None and options:
            raise CadenceError("give a RunConfig or options, not both")
        self.runner = Runner(config_of(config if config is not None else RunConfig.from_options(**options)))
        self.tokenizer = self.runner.tokenizer
        self.plan = self.runner.plan  # every choice made for the run (engine/plan.py), its memory plan under a budget
        self._ids = itertools.count()

    @classmethod
    def from_config(cls, cfg: RunConfig) -> "LLM":
        return cls(cfg)

    @property
    def config(self) -> RunConfig:
        """The run's options as given; what was decided from them (the draft `auto` took, the context, the
        profile's choices, the budget in bytes) is `plan`."""
        return self.plan.asked

    def generate(self, prompt: str | list[str], **kw) -> Completion | list[Completion]:
        """Complete `prompt` (raw text, no chat template). kw: max_new_tokens and the sampling
        controls (temperature, top_p, top_k, min_p, presence_penalty, frequency_penalty, repetition_penalty,
        repeat_last_n, seed: common/settings.py `SamplingConfig`). A list of
        prompts: their completions in the same order, generated `parallel` (an option of the LLM) at a time
        together, each greedy one exactly what it would be alone."""
        if isinstance(prompt, (list, tuple)):
            return self._generate_many(list(prompt), **kw)
        return _last(self.stream(prompt, **kw)).completion

    def _generate_many(self, texts: list[str], max_new_tokens: int | None = None, **sampling) -> list[Completion]:
        if not all(isinstance(t, str) for t in texts):
            raise CadenceError("generate takes a prompt or a list of prompts (strings)")
        prompts = [Prompt(f"api-{next(self._ids)}", "complete", t, chat=False) for t in texts]
        order = {p.id: i for i, p in enumerate(prompts)}
        out: list = [None] * len(prompts)
        for p, c in self.runner.stream_many(prompts, None, max_new_tokens, self._sampling(**sampling)):
            if isinstance(c, CadenceError):
                raise c
            if c.completion is not None:
                out[order[p.id]] = c.completion
        return out

    def stream(self, prompt: str, **kw) -> Iterator[Chunk]:
        """`generate` as chunks of text, as the model commits them; the last one carries the Completion.
        Stop iterating early and the generation stops at once."""
        return self._stream(Prompt(f"api-{next(self._ids)}", "complete", prompt, chat=False), **kw)

    def chat(self, messages: list[dict], tools: list[dict] | None = None, tool_choice="auto", **kw) -> Completion:
        """Answer a conversation ({"role": "system"|"user"|"assistant"|"tool", "content": ...} dicts, the
        last one the user's or a tool's) through the model's chat template. `tools` (OpenAI's form) are told to the
        model; the calls it makes are the completion's `tool_calls` (engine/tools.py `ToolCall`), its `text` what
        it said beside them, its finish_reason "tool_calls". `tool_choice`: "auto", "none", "required" or a
        function's name."""
        return _last(self.chat_stream(messages, tools, tool_choice, **kw)).completion

    def chat_stream(self, messages: list[dict], tools: list[dict] | None = None, tool_choice="auto", **kw):
        """`chat` as chunks of text (with tools: the answer as the model writes it, calls and all); the last chunk
        carries the Completion, its calls read out."""
        if not messages or not all(
            isinstance(m, dict)
            and m.get("role")
            and (isinstance(m.get("content"), str) or (m.get("content") is None and m.get("tool_calls")))
            for m in messages
        ):
            raise CadenceError('messages must be a non-empty list of {"role": ..., "content": "..."} dicts')
        prompt = Prompt(f"api-{next(self._ids)}", "chat", "", chat=True, messages=tuple(messages))
        if not tools:
            return self._stream(prompt, **kw)
        from engine import tools as calls

        if isinstance(tool_choice, str) and tool_choice not in ("auto", "none", "required"):  # a function's name
            tool_choice = {"type": "function", "function": {"name": tool_choice}}
        told, choice = calls.check_tools(tools, tool_choice)
        fmt = calls.format_of(self.tokenizer.info.chat_template)
        if fmt is None:
            raise CadenceError(calls.no_tools(self.plan.target_name))
        if choice == "none":
            return self._stream(prompt, **kw)
        start = calls.forced_start(fmt, choice) if choice != "auto" else ""
        if start and kw.get("grammar") is None and kw.get("json_schema") is None:  # the call held to its schema
            kw["grammar"] = calls.call_grammar(fmt, choice, told, kw.pop("parallel_tool_calls", True))
        prompt = dataclasses.replace(prompt, tools=tuple(told), start=start)
        return _with_calls(self._stream(prompt, **kw), fmt, start, calls.names(told))

    def _stream(self, prompt: Prompt, max_new_tokens: int | None = None, **sampling) -> Iterator[Chunk]:
        return self.runner.stream(prompt, max_new_tokens=max_new_tokens, sampling=self._sampling(**sampling))

    def _sampling(self, **given) -> SamplingConfig:
        """The run's sampling with what a call gave (`SAMPLING_FIELDS`: temperature, top_p, top_k, min_p, the
        penalties, repeat_last_n, seed, grammar; None: the run's own). `json_schema` (a dict) or `grammar` (a JSON
        schema, a Lark or GBNF grammar, or a file of one) holds the output to it (speculative/grammar.py)."""
        unknown = sorted(set(given) - set(SAMPLING_FIELDS) - {"json_schema"})
        if unknown:
            raise CadenceError(
                f"unknown argument {unknown[0]!r}; a generation takes max_new_tokens, json_schema and "
                f"{', '.join(SAMPLING_FIELDS)}"
            )
        schema = given.pop("json_schema", None)
        if schema is not None and given.get("grammar") is not None:
            raise CadenceError("json_schema and grammar both hold the output to a grammar; give one")
        if schema is not None or given.get("grammar") is not None:
            given["grammar"] = grammar_of(schema if schema is not None else given["grammar"])
        return dataclasses.replace(self.plan.sampling, **{k: v for k, v in given.items() if v is not None})

    def held_bytes(self) -> int:
        """What the run's processes hold now (PSS: anonymous and shared memory)."""
        return self.runner.held_bytes()

    def close(self) -> None:
        """Stop the actors and free the shared memory (also at the end of a `with` block)."""
        self.runner.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def config_of(cfg: RunConfig) -> RunConfig:
    """The configuration an LLM decides its run from (`launch chat` and `serve` come here too): a request may
    sample although the run's default is greedy, so its plan has room for the distributions."""
    return cfg.replace(plan_sampling=True)


def _with_calls(chunks: Iterator[Chunk], fmt, start: str, names: list[str]) -> Iterator[Chunk]:
    """The chunks as they come; the last one's Completion with the calls read out of the answer."""
    from engine import tools

    for chunk in chunks:
        c = chunk.completion
        if c is not None:
            text, found = tools.parse(start + c.text, fmt, names)
            if found:
                finish = "tool_calls" if c.finish_reason == "stop" else c.finish_reason
                c = dataclasses.replace(c, text=text.strip(), tool_calls=found, finish_reason=finish)
                chunk = dataclasses.replace(chunk, completion=c, finish_reason=finish)
        yield chunk


def _last(chunks: Iterator[Chunk]) -> Chunk:
    for chunk in chunks:
        pass
    return chunk
