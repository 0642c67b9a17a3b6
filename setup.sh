#!/usr/bin/env bash
# Sets up cadence in ./.venv: torch 2.13.0 (CPU) first, then the package, then the models.
#   ./setup.sh          runtime only, then pulls the default models
#   ./setup.sh --test   also the test dependencies (and headless Chromium for the trace viewer's test) and
#                       gemma-3-270m, which the tests of the Gemma family run
set -euo pipefail
cd "$(dirname "$0")"
extras=""
[ "${1:-}" = "--test" ] && extras="[test]"
py=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$py" -m venv .venv
fi
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
# The torch pin must come first: any unpinned torch requirement pulls several GB of CUDA wheels.
if ! .venv/bin/python -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null; then
    echo "cadence setup: installing torch==2.13.0 (CPU)"
    pip install "torch==2.13.0"
fi
echo "cadence setup: installing cadence${extras}"
printf 'torch==2.13.0\n' > .venv/constraints.txt
PIP_CONSTRAINT=.venv/constraints.txt pip install -e ".${extras}"
if [ -n "$extras" ]; then
    # the trace viewer's test drives a real headless Chromium (Debian chromium + chromium-driver)
    PYTHON=.venv/bin/python .ci/install-browser.sh
fi
echo "cadence setup: pulling the default models"
.venv/bin/launch models pull
if [ -n "$extras" ]; then
    echo "cadence setup: pulling gemma-3-270m (the tests' Gemma model)"
    .venv/bin/launch models pull gemma-3-270m
fi
