#!/usr/bin/env bash
# Fresh virtual environment, install exactly as the README says, run the whole test suite.
# Usage: bash tools/run_tests.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
[[ -x $VENV/bin/python ]] || python3 -m venv "$VENV"
# shellcheck disable=SC1091
. "$VENV/bin/activate"
python -m pip install -q -c constraints-cpu.txt -e ".[dev]"
start=$(date +%s)
set +e
python -m pytest -q --durations=15 "$@"
rc=$?
set -e
echo "test suite wall time: $(( $(date +%s) - start ))s"
# pytest exit 5 = no tests collected: treat as failure, a suite that runs nothing proves nothing.
exit $rc
