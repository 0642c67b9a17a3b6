"""One error type that reaches the user as a single readable sentence."""


class CadenceError(Exception):
    """Something the user can act on. The message says what was wrong and what to do.

    The CLI prints it as `launch: <message>` and exits non-zero, without a traceback.
    """
