#!/usr/bin/env bash
# Set up the test dependencies in .venv and run the whole test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")"
. scripts/venv.sh
qvl_venv "test,ray"
# Debian's Chromium drives the web-page test; the aarch64 cross compiler and qemu-user run the ARM
# kernel check (installed as root only; the tests skip, saying why, without them)
missing=""
command -v chromium >/dev/null 2>&1 || missing="$missing chromium"
command -v aarch64-linux-gnu-gcc >/dev/null 2>&1 || missing="$missing gcc-aarch64-linux-gnu libc6-dev-arm64-cross"
command -v qemu-aarch64 >/dev/null 2>&1 || missing="$missing qemu-user"
if [ -n "$missing" ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null) \
    || echo "test.sh: could not install$missing; the tests that need them will be skipped" >&2
fi
exec .venv/bin/python -m pytest "$@"
