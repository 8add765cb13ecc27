#!/usr/bin/env bash
# Set up the test dependencies in .venv and run the whole test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")"
. scripts/venv.sh
qvl_venv "test,ray"
# Debian's Chromium drives the web-page test (installed as root only; the test skips, saying why, without it)
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
    || echo "test.sh: could not install chromium; the web-page test will be skipped" >&2
fi
exec .venv/bin/python -m pytest "$@"
