#!/usr/bin/env bash
# The README's two Quick-start commands. Each first runs scripts/setup.sh, which sets up .venv
# in the repo root where anything is missing (and returns at once where nothing is), then:
#
#   bash scripts/quickstart.sh run  [ARGS...]   .venv/bin/ftis run ARGS      (the embedded default)
#   bash scripts/quickstart.sh test [ARGS...]   .venv/bin/python -m pytest ARGS, from the repo root
#
# `run` keeps the caller's working directory (the run directory lands in ./runs/).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd -P)

usage() {
  echo "usage: bash scripts/quickstart.sh run [ftis run args...]" >&2
  echo "       bash scripts/quickstart.sh test [pytest args...]" >&2
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
  run)
    bash "$ROOT/scripts/setup.sh"
    exec "$ROOT/.venv/bin/ftis" run "$@"
    ;;
  test)
    bash "$ROOT/scripts/setup.sh"
    cd "$ROOT"
    exec "$ROOT/.venv/bin/python" -m pytest "$@"
    ;;
  -h | --help | help)
    usage
    ;;
  *)
    usage
    exit 2
    ;;
esac
