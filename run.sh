#!/usr/bin/env bash
# Set up qvl in .venv and serve the model (API + web page). Extra arguments go to `qvl serve`.
# The model is $QVL_MODEL (default Qwen/Qwen3-VL-2B-Instruct): local folder -> HF cache -> download.
# Where it cannot be had, serve an offline demo checkpoint (random weights, official layout).
set -euo pipefail
cd "$(dirname "$0")"
. scripts/venv.sh
[ -x .venv/bin/qvl ] || qvl_venv ""
model="${QVL_MODEL:-Qwen/Qwen3-VL-2B-Instruct}"
if ! .venv/bin/python -c "import sys; from qvl.hub import resolve_model; resolve_model(sys.argv[1])" "$model" 2>/tmp/qvl-resolve.err; then
  echo "qvl: $(cat /tmp/qvl-resolve.err | tail -1)" >&2
  demo="checkpoints/demo-${QVL_DEMO_PRESET:-tiny}"
  echo "qvl: serving the offline demo checkpoint $demo instead (random weights: the answers are gibberish," >&2
  echo "     everything else is real). QVL_DEMO_PRESET=2b gives the real 2B shape and speed." >&2
  [ -f "$demo/model.safetensors" ] || .venv/bin/qvl synth "$demo" --preset "${QVL_DEMO_PRESET:-tiny}"
  model="$demo"
fi
exec .venv/bin/qvl serve --model "$model" "$@"
