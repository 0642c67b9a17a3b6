"""cadence: run language models larger than memory (see cadence.api for the Python API).

`import cadence` stays light: `cadence.LLM` loads the runtime on first use.
"""
from cadence.errors import CadenceError

__all__ = ["CadenceError", "Completion", "LLM"]


def __getattr__(name):
    if name in ("LLM", "Completion"):
        from cadence import api

        return getattr(api, name)
    raise AttributeError(f"module 'cadence' has no attribute {name!r}")
