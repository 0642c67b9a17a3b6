"""`launch serve`: the OpenAI-compatible HTTP API (serve/app.py) on 127.0.0.1:8080 by default."""
from __future__ import annotations

import sys

from common.errors import CadenceError
from launch.options import add_run_options, run_config


def add_parser(sub):
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP API (chat, completions, streaming, metrics)")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    p.add_argument("--queue", type=int, default=8, help="requests that may wait for the one running (more get 429)")
    add_run_options(p)
    p.set_defaults(func=cmd_serve)


def cmd_serve(args) -> int:
    import uvicorn

    from cadence.api import LLM
    from serve.app import Generator, make_app

    if not 1 <= args.port <= 65535:
        raise CadenceError(f"--port {args.port} is not a port; give 1-65535")
    if args.queue < 1:
        raise CadenceError(f"--queue {args.queue} must be at least 1")
    cfg = run_config(args)

    def make_llm():
        llm = LLM.from_config(cfg)
        c = llm.config
        print(llm.plan.summary() if llm.plan is not None else f"{c.mode} {c.target} {c.dtype}, draft {c.draft}; "
              f"context {c.context} tokens; {c.runtime}", file=sys.stderr, flush=True)
        return llm

    gen = Generator(make_llm, args.queue)
    gen.start()
    print(f"launch serve: loading {cfg.target} ({cfg.mode}, {cfg.dtype}) ...", file=sys.stderr, flush=True)
    gen.ready.wait()
    if gen.llm is None:
        raise CadenceError(f"the models could not be loaded: {gen.error}")
    app = make_app(gen, cfg.target, args.api_key, gen.llm.plan.budget if gen.llm.plan is not None else None)
    print(f"launch serve: http://{args.host}:{args.port}/v1 ({cfg.target}, mode {cfg.mode}); Ctrl-C stops",
          file=sys.stderr, flush=True)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    try:
        server.run()
    finally:
        gen.stop()
        gen.join(30)
    if gen.is_alive():
        raise CadenceError("the generation thread did not stop within 30 s; its actors were left to the watchdog")
    return 0
