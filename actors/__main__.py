"""`python -m actors '<json spec>'`: the process entry of every actor (see actors.base.actor_main).

The process ends with os._exit once the actor has flushed its trace and closed its socket: the
interpreter's own teardown (torch's static destructors, freeing a model's pages) takes close to a
second on a small machine, and there is nothing left for it to do.
"""

import json
import os
import sys

from actors.base import actor_main

code = actor_main(json.loads(sys.argv[1]))
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
