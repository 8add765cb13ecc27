# Sourced by run.sh and test.sh: make .venv and install qvl with the extras in $1 (e.g. "test,ray").
# torch comes as the CPU wheel: from a local wheel folder ($PIP_FIND_LINKS) or PyTorch's CPU
# index; a bare `pip install torch` from PyPI would pull a multi-GB CUDA build.
qvl_venv() {
  if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
    .venv/bin/pip install --quiet --upgrade pip
  fi
  if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    if [ -n "${PIP_FIND_LINKS:-}" ]; then
      .venv/bin/pip install --quiet torch==2.13.0 --find-links "$PIP_FIND_LINKS"
    else
      .venv/bin/pip install --quiet torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \
        || .venv/bin/pip install --quiet torch==2.13.0  # no CPU index reachable: whatever pip is configured with
    fi
  fi
  .venv/bin/pip install --quiet -e ".${1:+[$1]}"
}
