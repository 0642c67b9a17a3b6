"""Actors that misbehave on purpose, for the lifecycle tests (not fakes of a role)."""

import os
import time

from tests.runtime.fakes.actors import FakeActor

# a slow import delays HELLO: the hello_s timeout test
time.sleep(float(os.environ.get("CADENCE_TEST_IMPORT_SLEEP", "0")))


class SlowSetupActor(FakeActor):
    role = "slow"

    def __init__(self, init, ctx):
        super().__init__(init, ctx)
        time.sleep(init.get("sleep_s", 0))


class BrokenSetupActor(FakeActor):
    role = "broken"

    def __init__(self, init, ctx):
        super().__init__(init, ctx)
        raise RuntimeError("weights file is truncated")


class NotAnActor:
    pass


class SpammingActor(FakeActor):
    """Sends the scheduler garbage from inside an op."""

    role = "spam"

    def op_spam(self, n: int):
        for i in range(n):
            self.ctx.sock.send_multipart([b"\xff" if i % 2 else b"\x11", os.urandom(i % 50)])
        return {"sent": n}


class TreeActor(FakeActor):
    """Has a child process of its own, as a real loader with helper processes might."""

    role = "tree"

    def __init__(self, init, ctx):
        super().__init__(init, ctx)
        import subprocess

        self.child = subprocess.Popen(["sleep", "120"])

    def op_child(self):
        return {"pid": self.child.pid}


class SloppyActor(FakeActor):
    """Returns what the wire cannot carry."""

    role = "sloppy"

    def op_number(self):
        return 42

    def op_object(self):
        return {"x": object()}


class ChecksumActor(FakeActor):
    """A consumer of loaded slots: the crc32 of the bytes a descriptor names, after an optional sleep."""

    role = "consumer"

    def op_crc(self, tensors: dict, sleep_s: float = 0.0):
        import zlib

        import numpy as np

        d = tensors["x"]
        time.sleep(sleep_s)
        return {"crc": zlib.crc32(np.frombuffer(self.arenas[d.segment].buf, np.uint8, d.span_bytes, d.offset))}
