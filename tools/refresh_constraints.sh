#!/usr/bin/env bash
# Re-resolve the CPU lock file (constraints-cpu.txt) from setup.py in a scratch environment.
#
#   bash tools/refresh_constraints.sh          # writes constraints-cpu.txt; review `git diff`
#
# torch and megatron-core stay at the versions given below (the CPU wheel of torch on the
# machines' disk; megatron-core 0.16.1, the newest for Python 3.11); everything else takes the
# newest release that setup.py allows. Then run `bash tools/run_tests.sh` and
# `bash tools/quickstart.sh` (the base model must still reach its target) before committing.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH=${TORCH:-2.13.0}
MCORE=${MCORE:-0.16.1}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m venv "$tmp/venv"
"$tmp/venv/bin/python" -m pip install -q --upgrade pip
printf 'torch==%s\nmegatron-core==%s\n' "$TORCH" "$MCORE" > "$tmp/seed.txt"
"$tmp/venv/bin/python" -m pip install -q -c "$tmp/seed.txt" -e ".[dev,tasks]"
{
  echo "# CPU lock file: the exact versions tested on the CPU path (developers, CI, the quickstart)."
  echo "# Used as pip constraints: pip install -c constraints-cpu.txt -e \".[dev,tasks]\"."
  echo "# torch is pinned so no dependency pulls a multi-GB CUDA build; clusters install their own"
  echo "# CUDA torch and skip this file. Refresh: bash tools/refresh_constraints.sh (see README)."
  "$tmp/venv/bin/python" -m pip freeze --exclude-editable | grep -v '^-e ' | grep -v '^pip==' \
    | sed -E 's/^torch==([0-9.]+)\+cpu$/torch==\1/' | LC_ALL=C sort -f
} > constraints-cpu.txt
echo "wrote constraints-cpu.txt ($(grep -vc '^#' constraints-cpu.txt) pins)"
