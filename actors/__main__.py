"""`python -m actors '<json spec>'`: the process entry of every actor (see actors.base.actor_main)."""
import json
import sys

from actors.base import actor_main

sys.exit(actor_main(json.loads(sys.argv[1])))
