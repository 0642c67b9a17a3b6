"""One error type that reaches the user as a single readable sentence."""


class CadenceError(Exception):
    """Something the user can act on. The message says what was wrong and what to do.

    The CLI prints it as `launch: <message>` and exits non-zero, without a traceback.
    """


class UsageError(CadenceError):
    """An option that cannot work as given (a port another process listens on): exit status 2, bad usage."""


class PromptError(CadenceError):
    """One prompt cannot run (too long for the context, empty, not text): a run of many reports it and
    goes on with the others; a server answers its request with a client error. `param`: what to change
    ("prompt", or "max_tokens" when the prompt fits but the tokens asked for do not)."""

    def __init__(self, message: str, param: str = "prompt"):
        super().__init__(message)
        self.param = param


class Terminated(KeyboardInterrupt):
    """SIGTERM (what a service manager sends to stop a process): handled as Ctrl-C is, at once,
    wherever the main thread is, so the run stops its actors, writes its trace and what it finished."""

    def __init__(self, signum: int = 15):
        super().__init__(signum)
        self.signum = signum


def stop_on_sigterm() -> None:
    """From now on SIGTERM raises `Terminated` in the main thread, wherever it is (handled as Ctrl-C is)."""
    import signal

    def _terminated(signum, frame):
        raise Terminated(signum)

    signal.signal(signal.SIGTERM, _terminated)
