"""What every part of cadence shares: the user-facing error, paths, the run config."""
from cadence.errors import CadenceError

__all__ = ["CadenceError"]
