#!/usr/bin/env bash
# The GPU checks in one call (< 8 min on one H100/H200): Transformer Engine tiny model vs the local
# spec, SGLang launch + generate + behaviour log-probs + weight sync. Needs `pip install -e .[gpu,dev]`
# (TE and SGLang) on a CUDA machine. Writes its log (and a recorded SGLang /generate response, the
# fixture the CPU tests parse) to ${OUT:-gpu_check_out}/.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu_check_out}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
export P3O_RECORD_DIR="$out" PYTHONUNBUFFERED=1
timeout 480 python -m pytest tests/gpu -m "gpu or sglang" -v -s -rs 2>&1 | tee "$out/gpu_check.log"
exit "${PIPESTATUS[0]}"
