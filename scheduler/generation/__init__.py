"""Generation over the actors: the processes a run starts, the speculation cycle's sides as proxies
over the wire (`target_side.py`, `draft_side.py`), the streamed target's loader traffic (`streaming.py`), and
the memory plan that sizes it all under a budget (`memplan.py`, with `footprint.py`'s measurements),
and a mixture-of-experts buffer's eviction and preload policies (`expert_policy.py`, pure).

It stands on the runtime core (scheduler/: processes, requests, events, memory ledger, traces), which
knows nothing of models, and on the speculation cycle (speculative/loop.py), which knows nothing of
processes.
"""
