#!/usr/bin/env bash
# Installs the project and runs the main job: the tiny CPU recipe end to end (P3O on 2-digit
# addition; bf16 rollouts, fp32 trainer). The base model is the one shipped in bases/ (installed
# in ~10 s, checked against bases/SHA256SUMS).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
[[ -x $VENV/bin/python ]] || python3 -m venv "$VENV"
# shellcheck disable=SC1091
. "$VENV/bin/activate"
python -m pip install -q -c constraints-cpu.txt -e .
python tools/make_tiny_base.py --out runs/tiny_base
python -m megatron_p3o.train recipes/tiny_cpu.yaml "$@"
