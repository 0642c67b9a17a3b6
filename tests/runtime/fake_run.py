"""A whole fake run: the scheduler `launch run` uses (`ActorSession` over a `Runtime`) with the
fake actors of tests/runtime/fakes/actors.py, a fake model and a real memory plan of it. Tests import `fake_model`,
`fake_plan`, `small_config` and `speculation`; the fault tests also run it as a separate process
(`python -m tests.runtime.fake_run`) to SIGKILL or Ctrl-C the scheduler itself.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

from tests.runtime.fakes.actors import FAKES, fake_args, target_text, write_fake_store
from common.errors import CadenceError
from common.settings import SamplingConfig, TreeConfig, WorkerSplit
from scheduler.runtime_config import GiB, KiB, MiB, MemoryConfig, PipelineConfig, RuntimeConfig, Timeouts, TraceConfig
from scheduler.generation.memplan import Overheads, plan_memory
from scheduler.runtime import Runtime
from scheduler.generation.session import ActorSession, SessionSpec

VOCAB = 64
CONTEXT = 4096  # tokens a generation holds (the fake model's own context is far longer)
# the target: eight layers and a head in two parts, in forward order (formats/convert.py's groups)
GROUPS = {**{f"layer.{i}": 48 * KiB for i in range(8)}, "head.0": 64 * KiB, "head.1": 64 * KiB}
NO_OVERHEADS = Overheads(
    scheduler=0, watchdog=0, runtime=0, actor=0, exchange=64 * KiB, verifier_activations=0, draft_activations=0, code=0
)


def fake_model(path, seed: int = 0, **roles) -> str:
    """The fake model's directory; `roles`: each role's script (tests/runtime/fakes/actors.py)."""
    return write_fake_store(path, GROUPS, VOCAB, seed, **roles)


def fake_plan(resident: int = 2):
    """A real memory plan of the fake model with room for `resident` groups beside the slots:
    2 keeps 3 groups resident, spread between 7 streamed ones, in 2 slots of 64 KiB."""
    budget = NO_OVERHEADS.exchange + sum(sorted(GROUPS.values())[:resident]) + 3 * 64 * KiB
    return plan_memory(budget, GROUPS, 0, 0, 0, NO_OVERHEADS)


def small_config(trace_dir=None, plan=None, **timeouts) -> RuntimeConfig:
    """The arena holds the plan's slots (or four of 64 KiB) and 2 MiB to exchange tensors."""
    stream = plan.stream_bytes if plan is not None else 256 * KiB
    slot = plan.slot_bytes if plan is not None else 64 * KiB
    return RuntimeConfig(
        memory=MemoryConfig(budget_bytes=4 * GiB, arena_bytes=stream + 2 * MiB, stream_bytes=stream, sample_s=0.2),
        pipeline=PipelineConfig(layer_bytes=slot),
        timeouts=Timeouts(**{"hello_s": 30.0, "init_s": 30.0, "ready_s": 60.0, "request_s": 20.0, **timeouts}),
        trace=TraceConfig(enabled=trace_dir is not None, dir=str(trace_dir) if trace_dir else None),
    )


def speculation(
    sched: Runtime,
    store: str,
    mode: str = "tree",
    plan=None,
    draft: bool = True,
    worker: WorkerSplit | None = None,
    **tree,
) -> ActorSession:
    """`ActorSession` as `launch run` builds it, spawning the fakes; `draft` False: `--draft none`."""
    cfg = TreeConfig(**{"mode": "chain" if mode == "chain" else "tree", **tree})
    spec = SessionSpec(
        mode,
        store,
        fake_args(VOCAB),
        store if draft else None,
        SamplingConfig(),
        cfg,
        1,
        CONTEXT,
        plan=plan,
        worker=worker,
    )
    return ActorSession(sched, spec, impl=FAKES)


def prompt(n: int = 40, seed: int = 1) -> list[int]:
    """Text the target itself wrote, then its first half again: the n-gram trie has candidates."""
    text = target_text([seed % VOCAB, (seed * 7) % VOCAB], n, VOCAB)
    return text + text[: n // 2]


def main() -> int:
    """Generate until killed, streamed, with all four fakes: print one JSON line with the run id and
    pids once every actor is READY."""
    trace_dir = os.environ.get("CADENCE_TEST_TRACE_DIR")
    plan = fake_plan()
    try:
        with tempfile.TemporaryDirectory() as d, Runtime(small_config(trace_dir, plan)) as sched:
            spec = speculation(
                sched,
                fake_model(d, seed=int(os.environ.get("CADENCE_TEST_SEED", "0"))),
                plan=plan,
                worker=WorkerSplit(0.3, 0.2),
            )
            try:
                pids = {role: p.pid for role, p in sched.actors.items()}
                print(
                    json.dumps(
                        {
                            "run_id": sched.run_id,
                            "pids": pids,
                            "pid": os.getpid(),
                            "watchdog": sched.watchdog_pid,
                            "zygote": sched.zygote_pid,
                        }
                    ),
                    flush=True,
                )
                while True:
                    spec.loop.generate(prompt(), 2000, set())
            finally:
                spec.close()
    except KeyboardInterrupt:
        print("fake_run: interrupted", file=sys.stderr, flush=True)
        return 130
    except CadenceError as e:
        print(f"fake_run: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
