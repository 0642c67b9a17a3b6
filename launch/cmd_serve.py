"""`launch serve`: the OpenAI-compatible HTTP API (serve/app.py) on 127.0.0.1:8080 by default."""

from __future__ import annotations

import sys

from common.errors import CadenceError, UsageError
from launch.options import add_run_options, run_config
from observe.monitor import add_monitor_args


def add_parser(sub):
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP API (chat, completions, streaming, metrics)")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes and /metrics")
    p.add_argument("--open-metrics", action="store_true", help="with --api-key: /metrics without the key")
    p.add_argument("--queue", type=int, default=8, help="requests that may wait for a slot (more get 429)")
    p.add_argument("--max-body", default="4MiB", help="the largest request body taken (more gets 413)")
    p.add_argument("--quiet", action="store_true", help="no line per request on stderr")
    add_run_options(p, parallel=0)  # as many slots as the memory allows (engine/memory.py most_slots)
    add_monitor_args(p, trace=False)
    p.set_defaults(func=cmd_serve)


def cmd_serve(args) -> int:
    import uvicorn

    from cadence.api import LLM
    from common.units import parse_bytes
    from serve.app import ServeConfig, make_app
    from serve.generator import Generator

    if not 1 <= args.port <= 65535:
        raise CadenceError(f"--port {args.port} is not a port; give 1-65535")
    if args.queue < 1:
        raise CadenceError(f"--queue {args.queue} must be at least 1")
    _check_port(args.host, args.port)  # before the models load: minutes a busy port would waste
    max_body = parse_bytes(args.max_body)
    cfg = run_config(args)

    def make_llm():
        llm = LLM.from_config(cfg)
        print(llm.plan.summary(), file=sys.stderr, flush=True)
        return llm

    gen = Generator(make_llm, args.queue)
    gen.start()
    print(f"launch serve: loading {cfg.target} ({cfg.mode}, {cfg.dtype}) ...", file=sys.stderr, flush=True)
    gen.ready.wait()
    if gen.llm is None:
        raise CadenceError(f"the models could not be loaded: {gen.error}")
    run = gen.llm.plan
    budget = run.budget
    app = make_app(
        gen,
        ServeConfig(
            run.target_name,
            args.api_key,
            budget,
            max_body,
            args.open_metrics,
            f"flash-ffn-density-{run.ffn_density}" if run.approximate else None,
            access_log=not args.quiet,
        ),
    )
    print(
        f"launch serve: http://{args.host}:{args.port}/v1 ({run.target_name}, mode {run.mode}); Ctrl-C stops",
        file=sys.stderr,
        flush=True,
    )
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", access_log=False))
    mon = _monitor(args, gen)
    try:
        server.run()
    finally:
        mon.stop()
        gen.stop()
        gen.join(30)
    if gen.is_alive():
        raise CadenceError("the generation thread did not stop within 30 s; its actors were left to the watchdog")
    return 0


def _check_port(host: str, port: int) -> None:
    """One sentence (exit 2) where the address cannot be listened on: another process listens there, or the
    host is not this machine's."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as e:
        raise UsageError(f"--host {host} is not an address of this machine ({e.strerror or e}); give another") from None
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a port in TIME_WAIT is free
        try:
            s.bind(addr)
        except OSError as e:
            raise UsageError(
                f"port {port} on {host} is taken ({e.strerror}): another server listens there; "
                "stop it or give --port another"
            ) from None


def _monitor(args, gen):
    """The run's monitor (a dashboard on a terminal, log lines otherwise, none with --no-monitor), fed the
    generations' chunks."""
    from observe.feed import MonitorFeed
    from observe.monitor import open_monitor

    runner = gen.llm.runner
    feed = MonitorFeed(runner.sched, title=f"serve {runner.plan.mode} {runner.plan.target_name}")
    mon = open_monitor(feed, False if args.monitor is None else args.monitor)
    gen.on_chunk = feed.on_chunk
    mon.start()
    return mon
