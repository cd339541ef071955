#!/usr/bin/env bash
# The package as a user installs it: build the wheel, install it NON-editable (pinned,
# constraints-cpu.txt) into a fresh venv, and from a directory outside the checkout run the
# tiny recipe's --dry-run, both converters' --help, verify's --help and the stress tool's --help.
#
# Why: every other install path (quickstart, tests, CI) is `pip install -e`, which reads the
# source tree and so hides a package folder that find_packages leaves out of the wheel (a main
# whose wheel lacked megatron_p3o/rollout and megatron_p3o/hf passed 618 tests).
#
# Usage: bash tools/wheel_check.sh        (WHEEL_VENV=... to place the venv; default .venv-wheel)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
WHEEL_VENV=$(realpath -m "${WHEEL_VENV:-.venv-wheel}")
start=$(date +%s)
rm -rf "$WHEEL_VENV" .cache/wheel
python3 -m venv "$WHEEL_VENV"
"$WHEEL_VENV/bin/python" -m pip install -q -c constraints-cpu.txt wheel setuptools
# built from a copy of what setup.py packages: a build in the checkout would write build/ and
# *.egg-info there while run_tests.sh's `pip install -e .` does the same
away=$(mktemp -d)
trap 'rm -rf "$away"' EXIT
mkdir "$away/src"
cp -r setup.py megatron_p3o checkpoints_convert "$away/src/"
find "$away/src" -name __pycache__ -prune -exec rm -rf {} +
"$WHEEL_VENV/bin/python" -m pip wheel -q --no-deps --no-build-isolation "$away/src" -w .cache/wheel
rm -rf "$away/src"
whl=$(ls .cache/wheel/megatron_p3o-*.whl)
"$WHEEL_VENV/bin/python" -m pip install -q -c constraints-cpu.txt "$whl"
cp -r recipes "$away/recipes"  # a user's own copy of the recipes; no source tree on the path
cd "$away"
py="$WHEEL_VENV/bin/python"
"$py" - << 'EOF'
import pathlib, sys
import checkpoints_convert, megatron_p3o
for m in (megatron_p3o, checkpoints_convert):
    assert "site-packages" in m.__file__, f"{m.__name__} imported from {m.__file__}, not the wheel"
pkg = pathlib.Path(megatron_p3o.__file__).parent
print(f"wheel: {sum(1 for _ in pkg.rglob('*.py'))} modules of megatron_p3o installed at {pkg}")
EOF
"$py" -m megatron_p3o.train recipes/tiny_cpu.yaml --dry-run > dry_run.txt
head -1 dry_run.txt
for mod in checkpoints_convert.hf_to_megatron checkpoints_convert.megatron_to_hf \
  checkpoints_convert.verify megatron_p3o.stress megatron_p3o.train; do
  "$py" -m "$mod" --help > /dev/null || { echo "wheel_check: $mod --help failed" >&2; exit 1; }
  echo "wheel: python -m $mod --help OK"
done
echo "wheel_check: OK ($(basename "$whl"), $(($(date +%s) - start)) s)"
