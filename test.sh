#!/usr/bin/env bash
# Set up the test dependencies in .venv and run the whole test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
  .venv/bin/pip install --quiet --upgrade pip
fi
# the CPU wheel of torch (see run.sh)
if [ -n "${PIP_FIND_LINKS:-}" ]; then
  .venv/bin/pip install --quiet torch==2.13.0 --find-links "$PIP_FIND_LINKS"
else
  .venv/bin/pip install --quiet torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
fi
.venv/bin/pip install --quiet -e ".[test,ray]"
# Debian's Chromium drives the web-page test (installed as root only; the test skips, saying why, without it)
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
    || echo "test.sh: could not install chromium; the web-page test will be skipped" >&2
fi
exec .venv/bin/python -m pytest "$@"
