"""cadence: run language models larger than memory. The Python API is `cadence.LLM` (cadence/api.py).

`import cadence` stays light: `cadence.LLM` loads the runtime on first use.
"""

from common.errors import CadenceError

__all__ = ["CadenceError", "Chunk", "Completion", "LLM", "RunConfig"]


def __getattr__(name):
    if name in __all__:
        from cadence import api

        return getattr(api, name)
    raise AttributeError(f"module 'cadence' has no attribute {name!r}")
