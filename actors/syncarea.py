"""Where the verifier and the sparse worker meet during a split job: a few words in the arena.

No message travels per layer: both sides follow the same list of steps (actors/executor.py) and
tell each other where they are through sequence words, each written by one side only:

    offset    0  int64  verifier: (job << 32) | the last step it posted (a plan, Q of a layer, a linear's input)
    offset   64  int64  worker:   (job << 32) | the last step it finished
    offset  128  int64  scheduler: the id of a job that must stop (the worker or the verifier died)
    offset  192  int64[16]  the forward's plan (kind, T, n_shared, k0, maxc, nnz, n0 x 4, scale bits)
    then         int32[rows]       the worker's chunk counts of the layer (attention)
                 int32[rows + 1]   the plan's tree index: ptr
                 int32[rows (rows + 1) / 2]  and idx

Each word sits on its own cache line. A step's number only grows within a job, and job ids only
grow, so a stale word (the last job's) never passes for a new one. `ABANDONED` as the step says
the writer gave up the job. Every wait has a deadline and watches the actor's socket: a STOP, a
dead partner (the scheduler writes the stop word) or the next job's request ends it with a reason.
"""

from __future__ import annotations

import time

VERIFIER, WORKER, STOP = 0, 8, 16  # int64 word indices (64-byte lines)
HEADER = 24  # int64 word index of the plan header
HEADER_WORDS = 16
FORWARD, END = 1, 2  # the header's kind: a forward's plan follows, or the job is over
ABANDONED = 0xFFFFFFFF
SPIN = 200  # reads before the first nap: the partner's step is often microseconds away
NAP_S, NAP_MAX_S = 50e-6, 500e-6


class Abandoned(RuntimeError):
    """The other side (or the scheduler) ended the job: nothing more will come."""


class SyncArea:
    def __init__(self, buf, rows: int, fence=None):
        """`buf`: the arena slot (a uint8 tensor or buffer of at least `nbytes(rows)`); `rows`: the most rows a
        forward has; `fence`: the memory fence (default the kernels'; the torch-free FAKE actors pass their own)."""
        import numpy as np  # here, not at the top: the scheduler reads this module's layout without numpy or torch

        if fence is None:
            from models import kernels

            fence = kernels.lib().cad_fence
        self.fence = fence
        raw = np.asarray(buf.numpy() if hasattr(buf, "numpy") else np.frombuffer(buf, dtype=np.uint8))
        if raw.nbytes < self.nbytes(rows):
            raise ValueError(
                f"the sync area needs {self.nbytes(rows)} bytes for {rows} rows; the slot has {raw.nbytes}"
            )
        self.rows = rows
        self.words = raw[: (HEADER + HEADER_WORDS) * 8].view(np.int64)
        self.header = self.words[HEADER:]
        ints = raw[(HEADER + HEADER_WORDS) * 8 : self.nbytes(rows)].view(np.int32)
        self.nch, self.ptr, self.idx = ints[:rows], ints[rows : 2 * rows + 1], ints[2 * rows + 1 :]

    @staticmethod
    def nbytes(rows: int) -> int:
        return (HEADER + HEADER_WORDS) * 8 + 4 * (2 * rows + 1 + rows * (rows + 1) // 2)

    def post(self, word: int, job: int, step: int):
        # order matters: what the step hands over (Q, a plan, columns) is written before its number,
        # and the fence keeps a weakly ordered CPU from making the number visible first
        self.fence()
        self.words[word] = (job << 32) | step

    def wait(self, word: int, job: int, step: int, what: str, clock: "Clock", newer_ends: bool = False) -> bool:
        """Until the other side's `word` reaches `step` of `job` (True); `what` it waits for, for the errors.
        `newer_ends`: between two forwards, the verifier's next job (its word, or the next request) means
        this one ended while we napped (it starts a job only after the last one's end): False."""
        words, n, nap, deadline, message = self.words, 0, NAP_S, None, False
        while True:
            v = int(words[word])
            if v >> 32 == job:
                got = v & 0xFFFFFFFF
                if got == ABANDONED:
                    raise Abandoned(f"{clock.partner} gave up job {job} before {what}")
                if got >= step:
                    self.fence()  # what the step handed over is read only after its number
                    return True
            elif v >> 32 > job:
                if newer_ends:
                    return False
                raise Abandoned(
                    f"{clock.partner} moved on to job {v >> 32} while this side waited for {what} of job {job}"
                )
            if message:  # seen after a last look at the word: the next job's request comes only after this one's end
                if newer_ends:
                    return False
                raise Abandoned(f"a message arrived (a stop, or the next job) while this side waited for {what}")
            n += 1
            if n < SPIN:
                continue
            if int(words[STOP]) == job:
                raise Abandoned(f"the scheduler stopped job {job} (an actor died) while this side waited for {what}")
            now = time.monotonic()
            if deadline is None:
                deadline = now + clock.timeout_s
            elif now > deadline:
                raise TimeoutError(
                    f"{clock.partner} did not finish {what} within {clock.timeout_s:g} s "
                    "(raise timeouts.request_s if the machine is that slow)"
                )
            message = clock.interrupted()
            if not message:
                clock.maybe_beat(now)
                time.sleep(nap)
                nap = min(nap * 2, NAP_MAX_S)


class Clock:
    """A waiting actor's deadline and its ties to the outside: `interrupted()` (a message is waiting:
    a STOP, or the next job's request) ends a wait; `beat()` keeps it from looking hung."""

    def __init__(self, partner: str, timeout_s: float, interrupted, beat, beat_every_s: float):
        """`partner`: who the waits wait for, as the errors name it ("the sparse worker")."""
        self.partner, self.timeout_s = partner, timeout_s
        self.interrupted, self.beat, self.beat_every_s = interrupted, beat, beat_every_s
        self.next_beat = time.monotonic() + beat_every_s

    def maybe_beat(self, now: float | None = None):
        """Say "alive" if it is time (a long job between replies must not look hung)."""
        now = time.monotonic() if now is None else now
        if now >= self.next_beat:
            self.beat()
            self.next_beat = now + self.beat_every_s
