"""FAKE actors for the integration tests, with no model: `actors.py` (what they share, the fake store, the
loader and the sparse worker, and `FAKES`, the class paths `ActorSession(..., impl=FAKES)` spawns) and
`target.py` (the target and the draft). The actor processes import them by those paths, from the
repository root (`shm/watchdog.py` `python_env` puts it on their PYTHONPATH)."""
