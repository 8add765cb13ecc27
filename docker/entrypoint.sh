#!/bin/sh
# qvl's container entry. Kernels: the image carries a build made when it was built; the cache
# volume gets a copy, and a host whose CPU differs compiles its own there once (about a minute,
# kept for later starts). Model: $QVL_MODEL, a folder or a name `qvl pull` takes, pulled into the
# cache volume (resumed if a pull was cut; nothing is fetched when it is there). Then `qvl serve`
# on all interfaces. Other arguments: `entrypoint.sh serve [qvl serve options]`, or any qvl
# subcommand (`entrypoint.sh list`, `entrypoint.sh ask ...`).
set -eu
export QVL_CACHE_DIR="${QVL_CACHE_DIR:-/cache/qvl}"
export HF_HOME="${HF_HOME:-/cache/huggingface}"
prebuilt="${QVL_PREBUILT_KERNELS:-/opt/qvl/native}"

mkdir -p "$QVL_CACHE_DIR/native" "$HF_HOME"
if [ -d "$prebuilt" ]; then
  for lib in "$prebuilt"/*; do
    [ -e "$lib" ] && [ ! -e "$QVL_CACHE_DIR/native/${lib##*/}" ] && cp -p "$lib" "$QVL_CACHE_DIR/native/"
  done
fi

command="${1:-serve}"
[ "$#" -gt 0 ] && shift
if [ "$command" != serve ]; then
  exec qvl "$command" "$@"
fi
qvl info | sed -n '/^kernels/p' >&2  # compiles for this CPU when the volume has no build for it
model="${QVL_MODEL:-qwen3-vl:2b}"
if [ ! -d "$model" ]; then
  qvl pull "$model" >&2
fi
exec qvl serve --model "$model" --host 0.0.0.0 --port "${QVL_PORT:-8000}" "$@"
