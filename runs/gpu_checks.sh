#!/usr/bin/env bash
# The measurements only a GPU can make, as one run sized for a ~10-minute
# slot on one H100/H200. It uses the machine's own python3 with torch and triton (no setup,
# no network, no data: the benchmarks use random tokens). Logs go to $OUT (default gpu_checks/).
#
#   bash runs/gpu_checks.sh
#
#  1. the fused NAG kernel's CUDA tests (correctness vs the reference, inductor compile, sm_90 build)
#  2. the branch op alone at the published rows (16 × 2048 × 640, bf16): GB/s vs measured copy bandwidth
#  3. whole steps at the published shape, compiled: GPT vs NAG-fused (step time, peak memory, MFU)
#  4. GPT depth 20 compiled: MFU (nanochat reports ~40-46% on H100 in bf16)
#  5. (with EVAL_BUNDLE set) CORE batched vs one-at-a-time scoring on the GPU
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-gpu_checks}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
nvidia-smi -L | tee "$OUT/gpu.log"
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.log"

echo "=== 1. fused kernel CUDA tests ==="
"$PY" -m pytest -q tests/test_nag_kernels.py -k "cuda or hopper" 2>&1 | tee "$OUT/kernel_tests.log"

echo "=== 2. branch op at the published rows ==="
"$PY" -m scripts.bench_nag --sections op --impls reference,compiled,fused 2>&1 | tee "$OUT/branch_op.log"

echo "=== 3. published shape, compiled: GPT vs NAG-fused ==="
"$PY" -m scripts.bench_train --depth 64 --model-dim 640 --head-dim 128 --max-seq-len 2048 --device-batch-size 16 \
    --vocab-size 32768 --arch gpt,nag:fused --compile on --steps 10 --warmup 3 2>&1 | tee "$OUT/published_step.log"

echo "=== 4. GPT depth 20, compiled: MFU ==="
"$PY" -m scripts.bench_train --depth 20 --head-dim 128 --max-seq-len 2048 --device-batch-size 32 \
    --vocab-size 32768 --arch gpt --compile on --steps 10 --warmup 3 2>&1 | tee "$OUT/d20_mfu.log"

# 5. CORE scoring batched vs one at a time on the GPU (speed-up, share of near-tie examples re-scored).
#    Needs a local copy of the CORE eval bundle: set EVAL_BUNDLE=DIR.
if [ -n "${EVAL_BUNDLE:-}" ] && [ -d "$EVAL_BUNDLE" ]; then
    echo "=== 5. CORE batched vs one at a time ==="
    "$PY" -m scripts.bench_core --eval-bundle "$EVAL_BUNDLE" --depth 12 --dim 768 --seq-len 2048 --threads 0 2>&1 | tee "$OUT/core_batching.log"
fi
