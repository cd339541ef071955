#!/usr/bin/env bash
# The SGLang serving environment, made from the project's own files: a virtual environment
# ($SGLANG_VENV, default .venv-sglang) with sglang and sglang-router at the versions of
# constraints-sglang.txt (every package pinned: later releases of SGLang's dependencies cannot
# drift in), plus what a server needs on a CPU-only machine: the one-symbol libcuda.so.1
# stand-in built from tools/sglang_cpu/libcuda_stub.c into $SGLANG_VENV/p3o-cpu/.
#
# Why its own environment: SGLang pins torch 2.14.1 and transformers 5.19, which conflict with
# the trainer's pins; the trainer never imports sglang, it talks to the server over HTTP and a
# torch process group, and launches it with this environment's interpreter
# (rollout.sglang.python, default $SGLANG_PYTHON).
#
# Usage:  bash tools/sglang_env.sh            # then: export SGLANG_PYTHON=$PWD/.venv-sglang/bin/python
#         SGLANG_REFRESH=1 bash tools/sglang_env.sh   # re-resolve and rewrite the lock
# An up-to-date environment (same lock, same stub source) is left as it is (a few seconds).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${SGLANG_VENV:-.venv-sglang}
PIN_SGLANG=$(sed -n 's/^sglang==\(.*\)$/\1/p' constraints-sglang.txt)
PIN_ROUTER=$(sed -n 's/^sglang-router==\(.*\)$/\1/p' constraints-sglang.txt)
NEED_GB=14 # the environment takes about 11 GB (torch's CUDA libraries), plus pip's unpacking
STAMP="$VENV/p3o-cpu/stamp"
want=$(cat constraints-sglang.txt tools/sglang_cpu/libcuda_stub.c | sha256sum | cut -d' ' -f1)

if [[ -z ${SGLANG_REFRESH:-} && -f $STAMP && $(cat "$STAMP") == "$want" && -x $VENV/bin/python ]]; then
  echo "sglang env: $VENV is up to date (sglang $PIN_SGLANG, sglang-router $PIN_ROUTER)"
  exit 0
fi
command -v gcc > /dev/null || { echo "error: tools/sglang_env.sh needs gcc (apt-get install gcc) to build the libcuda.so.1 stand-in" >&2; exit 2; }
parent=$(dirname "$(realpath -m "$VENV")")
mkdir -p "$parent"
have_kb=$(df -Pk "$parent" | awk 'NR==2 {print $4}')
have_existing_kb=$( [[ -d $VENV ]] && du -sk "$VENV" | cut -f1 || echo 0)
if (( have_kb + have_existing_kb < NEED_GB * 1024 * 1024 )); then
  echo "error: the SGLang environment needs about ${NEED_GB} GB free under $parent; $((have_kb / 1024 / 1024)) GB are free (set SGLANG_VENV to a larger disk)" >&2
  exit 2
fi
start=$(date +%s)
rm -rf "$VENV"
python3 -m venv "$VENV"
if [[ -n ${SGLANG_REFRESH:-} ]]; then
  "$VENV/bin/pip" install -q "sglang==$PIN_SGLANG" "sglang-router==$PIN_ROUTER"
  { sed -n '1,/^[a-zA-Z]/{/^#/p}' constraints-sglang.txt; "$VENV/bin/pip" freeze | grep -v '^-e'; } > constraints-sglang.txt.new
  mv constraints-sglang.txt.new constraints-sglang.txt
  want=$(cat constraints-sglang.txt tools/sglang_cpu/libcuda_stub.c | sha256sum | cut -d' ' -f1)
else
  "$VENV/bin/pip" install -q -c constraints-sglang.txt "sglang==$PIN_SGLANG" "sglang-router==$PIN_ROUTER"
fi
mkdir -p "$VENV/p3o-cpu"
gcc -shared -fPIC -O2 -Wl,-soname,libcuda.so.1 -o "$VENV/p3o-cpu/libcuda.so.1" tools/sglang_cpu/libcuda_stub.c
echo "$want" > "$STAMP"
echo "sglang env: $VENV ready in $(( $(date +%s) - start ))s, $(du -sh "$VENV" | cut -f1) (sglang $PIN_SGLANG, sglang-router $PIN_ROUTER); export SGLANG_PYTHON=$(realpath "$VENV")/bin/python"
