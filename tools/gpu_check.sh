#!/usr/bin/env bash
# The GPU check that fits the machine this project can get: one H200, Python 3.12, torch 2.11
# (CUDA 13), transformers 5.17, no network, at most 64 MiB carried. Transformer Engine and SGLang
# cannot get there (276 MB + a source build; 373 MB of kernels): their client code is checked on
# CPU against SGLang's pinned source (tests/unit/test_sglang_protocol.py).
#
#   here:   bash tools/gpu_wheels.sh        # .whl/: megatron-core 0.16.1 cp312, datasets (+2 deps)
#   there:  bash tools/gpu_check.sh OUTDIR  # ≤ 10 min (step timeouts sum to 590 s); 11 files in
#                                           # OUTDIR, to commit under docs/gpu/
#
# 1. the tiny base model (the shipped one, installed in seconds), then the converter's checkpoint against transformers, logits on the GPU
# 2. the tiny recipe for 5 steps on one GPU: NCCL (world 1), local spec, bf16 params, the
#    embedded engine on the GPU (metrics.jsonl)
# 3. vocab_parallel_logprobs vs Megatron's vocab_parallel_cross_entropy, T=8192, V=151936, bf16:
#    time and peak-memory ratios, HBM bandwidth fraction (logprob.json)
# 4. a ~1B Llama-style model, forward + backward, bf16: tokens/s and MFU vs 790 TFLOP/s (mfu.json)
# 5. round 3 without TE/SGLang: the block-FP8 push quantizer on the device (bitwise = CPU), the
#    FP8 packing rule per recipe, host syncs in one micro-batch under CUDA (round3.json)
# 6. round 4 (issue 42): a real CUDA-IPC round trip of a weight bucket between two processes on
#    the one GPU in the colocated payload format, decoded as SGLang does; NCCL with 2 processes
#    on the one GPU where NCCL allows it (round4.json)
# 7. every model family's local spec, forward + backward on the GPU against transformers there
#    (logits, the embedding's gradient), and the fused log-prob (T=4096, V=151936) against
#    float64 and against the unfused kernel in bf16 (specs.json)
# 8. round 5 (issue 52): a colocated step on one GPU with the tiny Llama through the real client
#    against a stand-in server process that acts as SGLang 0.5.23 (null memory answers, memory
#    freed and taken back): release, train, push, resume, generate (order, bitwise weights,
#    the trainer's cache returned before the resume); another process can allocate the
#    trainer's cached memory only after return_cached_memory; one CUDA-IPC payload per receiver
#    against one shared by two (round5.json)
# 9. round 6 (issue 63): the fused log-prob kernel on the GPU over a padded vocabulary with small
#    chunks against float64; the colocated launch fraction from the GPU's own free memory; a
#    colocated payload made on the GPU at TP 1 shares no storage with its parameter (round6.json)
# Files: env.txt, summary.txt (each step's exit status and RESULT line), log.txt (everything),
# metrics.jsonl, logprob.json, mfu.json, round3.json, round4.json, specs.json, round5.json,
# round6.json.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: bash tools/gpu_check.sh OUTDIR}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=$PWD
CARRY=${CARRY:-.whl}  # the carried wheels (tools/gpu_wheels.sh)
if ls "$CARRY"/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/p3o-site "$CARRY"/*.whl \
    || { echo "gpu_check: installing the carried wheels failed" >&2; exit 1; }
  export PYTHONPATH=/tmp/p3o-site:$PWD
fi
PY=${PY:-python3}
W=${WORK:-/tmp/p3o-gpu}
DEV=${DEV:-cuda}  # DEV=cpu with small BENCH_ARGS: a smoke test of this script on a CPU machine
BENCH_ARGS=${BENCH_ARGS:-}
rm -rf "$W"
status=0
# step NAME TIMEOUT CMD...: output to log.txt; exit status and any RESULT line to summary.txt
step() {
  local name=$1 t=$2
  shift 2
  echo "== $name: $*" >> "$OUT/log.txt"
  local t0=$SECONDS
  timeout "$t" "$@" >> "$OUT/log.txt" 2>&1
  local rc=$?
  echo "$name rc=$rc $((SECONDS - t0))s $(tail -n 50 "$OUT/log.txt" | grep '^RESULT' | tail -1)" \
    | tee -a "$OUT/summary.txt"
  ((rc == 0)) || status=1
}
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  $PY -c "import sys, torch, transformers, megatron.core as m
print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda,
      'transformers', transformers.__version__, 'megatron-core', m.__version__)"
} > "$OUT/env.txt" 2>&1
step base 30 $PY tools/make_tiny_base.py --out "$W/base"
step verify 60 $PY -m checkpoints_convert.verify --hf "$W/base/hf" --ckpt "$W/base/ckpt"
step train 80 $PY -m megatron_p3o.train recipes/tiny_cpu.yaml \
  --set "model.checkpoint=$W/base/ckpt" --set "data.path=$W/base/train.jsonl" \
  --set "data.eval_path=$W/base/heldout.jsonl" --set data.eval_every=0 --set steps=5 \
  --set model.params_dtype=bfloat16 --set "rollout.device=$DEV" \
  --set "run.dir=$W/runs" --set run.name=gpu
cp "$W/runs/gpu/metrics.jsonl" "$OUT/metrics.jsonl" 2> /dev/null
step logprob 60 $PY benchmarks/bench_gpu.py logprob --device "$DEV" --out "$OUT" $BENCH_ARGS
step mfu 90 $PY benchmarks/bench_gpu.py mfu --device "$DEV" --out "$OUT" $BENCH_ARGS
step round3 80 $PY tools/gpu_round3.py --device "$DEV" --out "$OUT"
step round4 50 $PY tools/gpu_round4.py --device "$DEV" --out "$OUT"
step specs 60 $PY tools/gpu_specs.py --device "$DEV" --out "$OUT"
step round5 60 $PY tools/gpu_round5.py --device "$DEV" --out "$OUT"
step round6 20 $PY tools/gpu_round6.py --device "$DEV" --out "$OUT"
echo "gpu_check: $( ((status == 0)) && echo all steps passed || echo some steps FAILED)" \
  | tee -a "$OUT/summary.txt"
exit $status
