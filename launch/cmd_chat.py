"""`launch chat`: talk to the model, turn after turn.

Each answer streams as the target accepts it. The conversation goes through the model's chat
template whole every turn, and the verifier keeps its KV cache between turns: a turn's prompt starts
with the last one's prompt and answer, so only the new message is prefilled. `/reset` forgets the
conversation, `/exit` (or Ctrl-D) ends it. With `--tools FILE` (a JSON list of tools in OpenAI's form) the model
is told of them; a call it makes is shown, and the next line typed is the tool's answer to it.
"""

from __future__ import annotations

import sys

from cadence.api import LLM
from common.errors import CadenceError, PromptError
from engine.config import DEFAULT_NEW_TOKENS
from launch.cmd_run import bounded
from launch.options import add_run_options, run_config


def add_parser(sub):
    p = sub.add_parser("chat", help="an interactive, multi-turn chat (the KV cache kept between turns)")
    p.add_argument("--system", default=None, help="a system message to start the conversation with")
    p.add_argument("--tools", default=None, help="a JSON file of tools the model may call (OpenAI's form)")
    add_run_options(p)
    p.set_defaults(func=cmd_chat)


def cmd_chat(args) -> int:
    cfg = run_config(args)
    tools = _tools(args.tools)
    print(f"launch chat: loading {cfg.target} ({cfg.mode}, {cfg.dtype}) ...", file=sys.stderr, flush=True)
    with LLM.from_config(cfg) as llm:
        if not llm.tokenizer.info.chat_template:
            raise CadenceError(f"{cfg.target} has no chat template (a base model); use `launch run` to complete text")
        print(llm.plan.summary(), file=sys.stderr, flush=True)
        llm.runner.bound_new_tokens(DEFAULT_NEW_TOKENS)
        history = [{"role": "system", "content": args.system}] if args.system else []
        print("type a message; /reset forgets the conversation, /exit or Ctrl-D ends it", file=sys.stderr, flush=True)
        while (line := _read()) is not None:
            text = line.strip()
            if text in ("/exit", "/quit"):
                break
            if text == "/reset":
                history = history[:1] if args.system else []
                print("(conversation forgotten)", file=sys.stderr, flush=True)
            elif text:
                role = "tool" if history and history[-1].get("tool_calls") else "user"
                history = _turn(llm, history, {"role": role, "content": line} | _answering(history), tools)
    return 0


def _read() -> str | None:
    try:
        return input("> " if sys.stdin.isatty() else "")
    except EOFError:
        return None


def _tools(path: str | None) -> list[dict] | None:
    """The tools of a `--tools` file (a JSON list, or a request's object with "tools"), checked before the models
    load."""
    if path is None:
        return None
    import json
    from pathlib import Path

    from engine.tools import check_tools
    from common.files import read_text

    try:
        tools = json.loads(read_text(Path(path), "write it as a JSON list of tools"))
    except json.JSONDecodeError as e:
        raise CadenceError(f"{path} is not valid JSON ({e.msg}, line {e.lineno}); write it as a JSON list of tools")
    return check_tools(tools.get("tools") if isinstance(tools, dict) else tools, "auto", str(path))[0]


def _answering(history: list[dict]) -> dict:
    """A tool's answer names the call it answers (the last of the model's calls)."""
    calls = history[-1].get("tool_calls") if history else None
    return {"tool_call_id": calls[-1]["id"]} if calls else {}


def _turn(llm: LLM, history: list[dict], message: dict, tools=None) -> list[dict]:
    """One exchange: the answer streamed, the conversation with it (without it if it could not run)."""
    asked = [*history, message]
    try:
        for chunk in llm.chat_stream(asked, tools):
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
    except PromptError as e:  # the conversation outgrew the context: say so, keep the session
        print(f"\nlaunch chat: {e}; /reset starts over", file=sys.stderr, flush=True)
        return history
    reply = chunk.completion
    print(flush=True)
    bounded(llm.plan.max_new_tokens, reply, "launch chat")
    print(
        f"[{len(reply.token_ids)} tokens, {reply.tokens_per_s:.2f} tok/s, "
        f"{reply.stats.get('reused_prompt_tokens', 0)} of {reply.prompt_tokens} prompt tokens from the cache]",
        file=sys.stderr,
        flush=True,
    )
    if reply.tool_calls:  # shown; the next line typed is the tool's answer
        calls = [c.openai() for c in reply.tool_calls]
        for c in reply.tool_calls:
            print(f"[tool call {c.name}({c.arguments}): type its answer]", file=sys.stderr, flush=True)
        return [*asked, {"role": "assistant", "content": reply.text or None, "tool_calls": calls}]
    return [*asked, {"role": "assistant", "content": reply.text}]
