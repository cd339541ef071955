#!/usr/bin/env bash
# Installs the project and runs the main job (the tiny CPU recipe end to end).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
[[ -x $VENV/bin/python ]] || python3 -m venv "$VENV"
# shellcheck disable=SC1091
. "$VENV/bin/activate"
python -m pip install -q -c constraints-cpu.txt -e .
if [[ ! -f recipes/tiny_cpu.yaml ]]; then
  echo "The tiny CPU recipe arrives with the trainer (issue #6); nothing to run yet." >&2
  exit 1
fi
python -m megatron_p3o.train recipes/tiny_cpu.yaml "$@"
