"""`launch chat`: talk to the model, turn after turn.

Each answer streams as the target accepts it. The conversation goes through the model's chat
template whole every turn, and the verifier keeps its KV cache between turns: a turn's prompt starts
with the last one's prompt and answer, so only the new message is prefilled. `/reset` forgets the
conversation, `/exit` (or Ctrl-D) ends it.
"""
from __future__ import annotations

import sys

from cadence.errors import CadenceError
from launch.options import add_model_args, run_config


def add_parser(sub):
    p = sub.add_parser("chat", help="an interactive, multi-turn chat (the KV cache kept between turns)")
    p.add_argument("--mode", default="tree", choices=("target", "std", "stdpl", "chain", "tree"))
    p.add_argument("--system", default=None, help="a system message to start the conversation with")
    add_model_args(p)
    p.set_defaults(func=cmd_chat)


def cmd_chat(args) -> int:
    from cadence.api import LLM

    cfg = run_config(args, args.mode)
    print(f"launch chat: loading {cfg.target} ({cfg.mode}, {cfg.fmt}) ...", file=sys.stderr, flush=True)
    with LLM(cfg.target, cfg.draft, dtype=cfg.fmt, draft_dtype=cfg.draft_fmt, mode=cfg.mode,
             memory_budget=cfg.memory_budget, context=cfg.plan_context or 4096, max_new_tokens=cfg.max_new_tokens,
             temperature=cfg.sampling.temperature, top_p=cfg.sampling.top_p, seed=cfg.sampling.seed,
             threads=cfg.threads, trace_dir=None if args.no_trace else (cfg.trace_dir or ""), tree=cfg.tree) as llm:
        if not llm.tokenizer.info.chat_template:
            raise CadenceError(f"{cfg.target} has no chat template (a base model); use `launch run` to complete text")
        if llm.plan is not None:
            print(llm.plan.summary(), file=sys.stderr, flush=True)
        history = [{"role": "system", "content": args.system}] if args.system else []
        print("type a message; /reset forgets the conversation, /exit or Ctrl-D ends it", file=sys.stderr, flush=True)
        while True:
            try:
                line = input("> " if sys.stdin.isatty() else "")
            except EOFError:
                break
            text = line.strip()
            if not text:
                continue
            if text in ("/exit", "/quit"):
                break
            if text == "/reset":
                history = history[:1] if args.system else []
                print("(conversation forgotten)", file=sys.stderr, flush=True)
                continue
            history.append({"role": "user", "content": line})
            steps = llm.chat_stream(history)
            try:
                while True:
                    sys.stdout.write(next(steps))
                    sys.stdout.flush()
            except StopIteration as done:
                reply = done.value
            history.append({"role": "assistant", "content": reply.text})
            print(f"\n[{len(reply.token_ids)} tokens, {reply.tokens_per_s:.2f} tok/s, "
                  f"{reply.stats.get('reused_prompt_tokens', 0)} of {reply.prompt_tokens} prompt tokens from the cache]",
                  file=sys.stderr, flush=True)
    return 0
