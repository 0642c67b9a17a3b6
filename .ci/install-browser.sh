#!/usr/bin/env bash
# CI: what tests/launch/test_trace_html.py drives: headless Chromium and its chromedriver (Debian
# packages chromium + chromium-driver, one version; a font for the labels) and selenium in
# ./.venv. Idempotent. Run it before the tests, as root or with sudo; PYTHON=... picks another
# interpreter than .venv/bin/python.
set -euo pipefail
cd "$(dirname "$0")/.."
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
    echo "install-browser: apt-get install chromium chromium-driver"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium chromium-driver fonts-dejavu-core
fi
py=${PYTHON:-.venv/bin/python}
if ! "$py" -c 'import selenium' 2>/dev/null; then
    echo "install-browser: pip install selenium"
    "$py" -m pip --disable-pip-version-check -q install "selenium>=4.11"
fi
chromium --version
chromedriver --version
"$py" -c 'import selenium; print("selenium", selenium.__version__)'
