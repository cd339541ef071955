#!/usr/bin/env bash
# Installs the project and runs the main job: the tiny CPU recipe end to end (P3O on 2-digit
# addition; bf16 rollouts, fp32 trainer). The base model is made on first use (~1 min on an idle
# 2-core machine, several on a loaded one).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
[[ -x $VENV/bin/python ]] || python3 -m venv "$VENV"
# shellcheck disable=SC1091
. "$VENV/bin/activate"
python -m pip install -q -c constraints-cpu.txt -e .
python tools/make_tiny_base.py --out runs/tiny_base
python -m megatron_p3o.train recipes/tiny_cpu.yaml "$@"
