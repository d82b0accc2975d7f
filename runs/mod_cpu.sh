#!/usr/bin/env bash
# Mixture-of-Depths at the CPU demo's scale (docs/mod.md): next to runcpu.sh's GPT / NAG pair, on the same
# FLOP budget and data order, NAG-MoD at 20 % (iso-FLOP: more steps, more tokens) and the router GPT-MoD
# baseline at 20 % (paper eq. 40); the inference trade-off curve of the full-depth NAG model; one report.
#
#   bash runs/mod_cpu.sh           # runs runcpu.sh first if its runs are missing (that part takes longer)
#
# No flags (--help prints this); settings are environment variables: NANOCHAT_BASE_DIR (a relative path is
# taken from the directory you run it in), TARGET_FLOPS, RATE, CURVE.
# Re-running skips finished runs and evaluations.
set -euo pipefail
case "${1:-}" in  # --help prints the comment above
    -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; exit 0 ;;
    ?*) echo "error: mod_cpu.sh takes no arguments (see --help)" >&2; exit 1 ;;
esac
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# the base dir made absolute before setup_env.sh changes to the repo root: a relative one is the caller's
export NANOCHAT_BASE_DIR="${NANOCHAT_BASE_DIR:-$HOME/.cache/nanochat}"
case "$NANOCHAT_BASE_DIR" in /*) ;; *) NANOCHAT_BASE_DIR="$PWD/$NANOCHAT_BASE_DIR" ;; esac
source "$HERE/setup_env.sh"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(nproc 2>/dev/null || echo 2)}"
BASE="$NANOCHAT_BASE_DIR"
TARGET_FLOPS="${TARGET_FLOPS:-1e13}"   # runcpu.sh's budget
RATE="${RATE:-0.2}"
CURVE="${CURVE:-0.05,0.1,0.2,0.3,0.4}"
stage() { echo; echo "=== $* ==="; }

if [ ! -f "$BASE/runs/cpu-gpt/eval.json" ] || [ ! -f "$BASE/runs/cpu-nag/eval.json" ]; then
    stage "the demo's GPT / NAG pair (runs/runcpu.sh)"
    bash "$HERE/runcpu.sh"
fi

# runcpu.sh's model and schedule (preset demo), unchanged; the router trains at the demo's NAG gate LR
MODEL=(--preset demo --target-flops "$TARGET_FLOPS")
TAG="$(awk "BEGIN { print int($RATE * 100 + 0.5) }")"   # 0.2 → 20

stage "NAG-MoD at ${RATE} (both blocks, iso-FLOP)"
python -m scripts.base_train --arch nag --mod-rate "$RATE" --mod-blocks both --run "cpu-nag-mod$TAG" "${MODEL[@]}" --resume latest
stage "router GPT-MoD at ${RATE} (paper eq. 40)"
python -m scripts.base_train --arch gpt-router --router-lr 0.01 --mod-rate "$RATE" --mod-blocks both --run "cpu-gpt-router$TAG" "${MODEL[@]}" --resume latest

stage "evaluate (bpb) and the inference curve of the full-depth NAG model"
# --skip-done: what each run's eval.json already holds at these settings is kept, the rest measured
for run in "cpu-nag-mod$TAG" "cpu-gpt-router$TAG"; do
    python -m scripts.base_eval --run "$run" --eval bpb --split-tokens 65536 --device-batch-size 4 --skip-done
done
python -m scripts.base_eval --run cpu-nag --eval bpb --split-tokens 65536 --device-batch-size 4 \
    --mod-rate "$CURVE" --mod-blocks both --mod-calib-tokens 65536 --skip-done

stage "comparison report"
python -m scripts.compare cpu-gpt cpu-nag "cpu-nag-mod$TAG" "cpu-gpt-router$TAG" --out "$NANOCHAT_BASE_DIR/reports/mod_cpu$TAG"
