#!/usr/bin/env bash
# One-command set-up: the right torch build first, then ftis with its dev tools.
#
# torch: an unpinned `torch` from PyPI is a multi-GB CUDA build. On a machine without an NVIDIA
# GPU we ask for the CPU build (FTIS_TORCH_SPEC, default torch==2.13.0, which pip takes from a
# local CPU wheel where one is configured); with a GPU we let pip pick its default CUDA build.
# Set FTIS_TORCH_INDEX to a CPU wheel index URL on CPU machines whose pip has no local CPU wheel.
# An importable torch is left alone.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if "$PY" -c "import torch" 2>/dev/null; then
  echo "setup: torch $("$PY" -c 'import torch; print(torch.__version__)') already installed"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "setup: NVIDIA GPU found: installing a CUDA build of torch"
  "$PY" -m pip install "${FTIS_TORCH_SPEC_GPU:-torch>=2.4}"
else
  echo "setup: no GPU: installing a CPU build of torch"
  if [ -n "${FTIS_TORCH_INDEX:-}" ]; then
    "$PY" -m pip install "${FTIS_TORCH_SPEC:-torch==2.13.0}" --index-url "$FTIS_TORCH_INDEX"
  else
    "$PY" -m pip install "${FTIS_TORCH_SPEC:-torch==2.13.0}"
  fi
fi
"$PY" -m pip install -e ".[dev]"
echo "setup: done. Try: ftis run"
