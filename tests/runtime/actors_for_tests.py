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

    def op_spam(self, args, tensors):
        for i in range(args["n"]):
            self.ctx.sock.send_multipart([b"\xff" if i % 2 else b"\x11", os.urandom(i % 50)])
        return {"sent": args["n"]}


class TreeActor(FakeActor):
    """Has a child process of its own, as a real loader with helper processes might."""

    role = "tree"

    def __init__(self, init, ctx):
        super().__init__(init, ctx)
        import subprocess

        self.child = subprocess.Popen(["sleep", "120"])

    def op_child(self, args, tensors):
        return {"pid": self.child.pid}


class SloppyActor(FakeActor):
    """Returns what the wire cannot carry."""

    role = "sloppy"

    def op_number(self, args, tensors):
        return 42

    def op_object(self, args, tensors):
        return {"x": object()}


class ChecksumActor(FakeActor):
    """A consumer of loaded slots: the crc32 of the bytes a descriptor names, after an optional sleep."""

    role = "consumer"

    def op_crc(self, args, tensors):
        import zlib

        import numpy as np

        d = tensors["x"]
        time.sleep(float(args.get("sleep_s", 0.0)))
        return {"crc": zlib.crc32(np.frombuffer(self.arenas[d.segment].buf, np.uint8, d.span_bytes, d.offset))}
