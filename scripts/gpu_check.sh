#!/usr/bin/env bash
# GPU check (issue 11): random Qwen2.5-0.5B-shaped model, ftis sampler vs HF generate, a few
# F-TIS steps; prints tokens/s, step time and peak memory. At most 8 minutes, no network.
#   scripts/gpu_check.sh            # one NVIDIA GPU
#   scripts/gpu_check.sh --dry-run  # CPU, tiny shape (or FTIS_GPU_CHECK_DRY_RUN=1)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
args=("$@")
if [ "${FTIS_GPU_CHECK_DRY_RUN:-0}" = "1" ]; then args+=(--dry-run); fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec timeout 480 "$PY" scripts/gpu_check.py "${args[@]}"
