"""`/metrics`: the server's counters and the run's figures in Prometheus' text format."""

from __future__ import annotations

import sys
import time

from serve.generator import Generator


def prometheus(gen: Generator, budget: int | None) -> str:
    m, llm = gen.stats, gen.llm
    lines = []

    def metric(name: str, kind: str, help_: str, value) -> None:
        lines.extend([f"# HELP cadence_{name} {help_}", f"# TYPE cadence_{name} {kind}", f"cadence_{name} {value}"])

    metric("requests_total", "counter", "Generation requests accepted", m.requests)
    metric("requests_rejected_total", "counter", "Requests refused with 429: the queue was full", m.rejected)
    metric("requests_cancelled_total", "counter", "Generations stopped because their client went away", m.cancelled)
    metric("generated_tokens_total", "counter", "Tokens generated", m.tokens)
    metric("prompt_tokens_total", "counter", "Prompt tokens processed", m.prompt_tokens)
    reused = "Prompt tokens whose KV rows were found cached (their slot's, or the prompt cache's)"
    metric("prompt_tokens_reused_total", "counter", reused, m.prompt_reused)
    missed = "Prompt tokens prefilled: no cache held them"
    metric("prompt_tokens_prefilled_total", "counter", missed, m.prompt_tokens - m.prompt_reused)
    metric("queue_depth", "gauge", "Requests waiting for the generation thread", gen.jobs.qsize())
    metric("tokens_per_second", "gauge", "Tokens per second of the last generation", m.last_tokens_per_s)
    metric(
        "accepted_per_verification",
        "gauge",
        "Draft tokens the target accepted per verification, since start",
        round(m.accepted / m.verifications, 4) if m.verifications else 0,
    )
    metric(
        "disk_read_gbps",
        "gauge",
        "Weight bytes read from disk per second of read time, since start",
        round(m.bytes_read / m.read_s / 1e9, 4) if m.read_s else 0,
    )
    metric("disk_read_bytes_total", "counter", "Weight bytes read from disk", m.bytes_read)
    metric("generating", "gauge", "Generations under way (at most --parallel)", int(gen.busy))
    if llm is not None and llm.plan.parallel > 1:
        metric("slots", "gauge", "Generations that may run at once (--parallel)", llm.plan.parallel)
        lines.extend(
            [
                "# HELP cadence_slot_tokens Tokens the generation in each busy slot has made so far",
                "# TYPE cadence_slot_tokens gauge",
            ]
        )
        lines.extend(f'cadence_slot_tokens{{slot="{s}"}} {n}' for s, n in sorted(dict(gen.slots).items()))
    metric("live_tokens", "gauge", "Tokens the generation under way (or the last) has decoded", m.live_tokens)
    metric(
        "live_tokens_per_second",
        "gauge",
        "Tokens per second of the generation under way (or the last), its prompt's pass aside",
        round(m.live_tokens_per_s, 3),
    )
    metric(
        "live_accepted_per_verification",
        "gauge",
        "Draft tokens accepted per verification in the generation under way (or the last)",
        round(m.live_accepted / m.live_verifications, 3) if m.live_verifications else 0,
    )
    if budget:
        metric("memory_budget_bytes", "gauge", "The memory budget the run was planned for", budget)
    if llm is not None:
        if llm.plan.memory is not None:
            metric("memory_planned_bytes", "gauge", "What the plan expects the processes to hold", llm.plan.memory.held)
        held = llm.held_bytes()
        if held:
            metric("memory_held_bytes", "gauge", "What the run's processes hold now (PSS: anonymous and shared)", held)
        for line in run_info(llm.plan):
            lines.append(line)
    return "\n".join(lines) + "\n"


def run_info(plan) -> list[str]:
    """What the run is: one info metric whose labels are its options, as decided (Prometheus' *_info
    convention)."""
    labels = ",".join(f'{k}="{_escape(v)}"' for k, v in plan.options().items() if v is not None)
    return [
        "# HELP cadence_run_info The run's options",
        "# TYPE cadence_run_info gauge",
        f"cadence_run_info{{{labels}}} 1",
    ]


def _escape(v) -> str:
    return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class AccessLog:
    """One line per request on stderr, after its response has gone (a stream's last event included): method,
    path, status, the tokens it generated, seconds; as llama-server and uvicorn users expect to see."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0, status = time.perf_counter(), [0]
        scope.setdefault("state", {})

        async def sending(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            job = scope["state"].get("job")
            tokens = f" {job.tokens} tokens" if job is not None and job.tokens is not None else ""
            code = status[0] or 499  # no response started: the client left first
            line = f"{scope['method']} {scope['path']} {code}{tokens} {time.perf_counter() - t0:.2f} s"
            print(line, file=sys.stderr, flush=True)
