"""A whole fake run: a scheduler, the four fake actors and the pipeline. Tests import
`small_config` and `spawn_fakes`; the fault tests also run it as a separate process
(`python -m tests.runtime.fake_run`) to SIGKILL or Ctrl-C the scheduler itself.
"""
from __future__ import annotations

import json
import os
import sys

from actors.fake import FAKES
from cadence.errors import CadenceError
from scheduler.config import GiB, KiB, MemoryConfig, PartitionConfig, PipelineConfig, RuntimeConfig, Timeouts, TraceConfig
from scheduler.pipeline import run_pipeline
from scheduler.policy import PipelinePolicy
from scheduler.runtime import Scheduler


def small_config(trace_dir=None, max_tokens=24, **timeouts) -> RuntimeConfig:
    """4 streaming slots of 64 KiB for 8 layers: the loader must reuse slots every round."""
    return RuntimeConfig(
        memory=MemoryConfig(budget_bytes=4 * GiB, arena_bytes=1024 * KiB, stream_bytes=256 * KiB, sample_s=0.2),
        partition=PartitionConfig(attn_sparse_share=0.3, linear_cpu_share=0.2),
        pipeline=PipelineConfig(n_layers=8, layer_bytes=64 * KiB, verify_width=6, max_tokens=max_tokens),
        timeouts=Timeouts(**{"hello_s": 30.0, "init_s": 30.0, "ready_s": 60.0, "request_s": 20.0, **timeouts}),
        trace=TraceConfig(enabled=trace_dir is not None, dir=str(trace_dir) if trace_dir else None),
    )


def spawn_fakes(sched: Scheduler, seed: int = 0, roles=tuple(FAKES)) -> dict[str, int]:
    """Start the fakes in parallel (each pays interpreter start once); returns role -> pid."""
    init = {"seed": seed, "stream_bytes": sched.config.memory.stream_bytes}
    for role in roles:
        sched.spawn(role, FAKES[role], init, wait=False)
    sched.wait_ready(list(roles))
    return {role: sched.actors[role].pid for role in roles}


def policy_for(sched: Scheduler) -> PipelinePolicy:
    c = sched.config
    return PipelinePolicy(c.pipeline, c.partition, c.memory.stream_bytes)


def main() -> int:
    """Run until killed: print one JSON line with the run id and pids once every actor is READY."""
    trace_dir = os.environ.get("CADENCE_TEST_TRACE_DIR")
    try:
        with Scheduler(small_config(trace_dir, max_tokens=10**9)) as sched:
            pids = spawn_fakes(sched, seed=int(os.environ.get("CADENCE_TEST_SEED", "0")))
            print(json.dumps({"run_id": sched.run_id, "pids": pids, "pid": os.getpid(),
                              "watchdog": sched._watchdog.proc.pid, "zygote": sched.zygote_pid}), flush=True)
            run_pipeline(sched, policy_for(sched))
    except KeyboardInterrupt:
        print("fake_run: interrupted", file=sys.stderr, flush=True)
        return 130
    except CadenceError as e:
        print(f"fake_run: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
