#!/usr/bin/env bash
# Set up qvl in .venv and serve the model (API + web page). Extra arguments go to `qvl serve`.
# The model is $QVL_MODEL (default Qwen/Qwen3-VL-2B-Instruct): local folder -> HF cache -> download.
# Where it cannot be had, serve the small trained demo models that ship with qvl, Qwen3-VL- and
# Qwen3.5-shaped (they read short text and name shapes' colours: docs/demo-models.md; the page's
# model picker chooses); QVL_DEMO_PRESET=2b serves random weights in the real 2B shape instead
# (real speed, gibberish answers).
set -euo pipefail
cd "$(dirname "$0")"
. scripts/venv.sh
[ -x .venv/bin/qvl ] || qvl_venv ""
model="${QVL_MODEL:-Qwen/Qwen3-VL-2B-Instruct}"
models=(--model "$model")
if ! .venv/bin/python -c "import sys; from qvl.hub import resolve_model; resolve_model(sys.argv[1])" "$model" 2>/tmp/qvl-resolve.err; then
  echo "qvl: $(cat /tmp/qvl-resolve.err | tail -1)" >&2
  if [ -n "${QVL_DEMO_PRESET:-}" ]; then
    demo="checkpoints/demo-$QVL_DEMO_PRESET"
    echo "qvl: serving $demo instead (random weights in the $QVL_DEMO_PRESET shape: gibberish answers)." >&2
    [ -f "$demo/model.safetensors" ] || .venv/bin/qvl synth "$demo" --preset "$QVL_DEMO_PRESET"
    models=(--model "$demo")
  else
    models=(--model "qwen3-vl-demo=$(.venv/bin/python -m qvl.demo path)"
            --model "qwen3.5-demo=$(.venv/bin/python -m qvl.demo path --arch qwen3.5)")
    echo "qvl: serving the small trained demo models instead (Qwen3-VL- and Qwen3.5-shaped): they read short" >&2
    echo "     text and name shapes' colours (try the web page's examples); they are not the real model." >&2
    echo "     QVL_DEMO_PRESET=2b: the real 2B shape, random weights." >&2
  fi
fi
exec .venv/bin/qvl serve "${models[@]}" "$@"
