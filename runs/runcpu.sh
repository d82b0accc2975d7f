#!/usr/bin/env bash
# The whole pipeline at toy scale on a CPU, in minutes, with no network needed:
# environment → corpus → tokenizer → a FLOP-matched GPT / NAG pair → CORE + bpb → analysis → comparison report.
#
#   bash runs/runcpu.sh                 # everything under ~/.cache/nanochat (or $NANOCHAT_BASE_DIR)
#   EVAL_BUNDLE=/path/to/eval_bundle bash runs/runcpu.sh    # a local copy of the CORE bundle (no download)
#
# No flags (--help prints this); settings are environment variables: NANOCHAT_BASE_DIR, EVAL_BUNDLE (relative
# paths are taken from the directory you run it in), TARGET_FLOPS, MAX_PER_TASK.
# Re-running skips what is already done (data, tokenizer, finished runs, evaluations) and
# continues an interrupted run from its newest complete checkpoint.
set -euo pipefail
case "${1:-}" in  # --help prints the comment above
    -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; exit 0 ;;
    ?*) echo "error: runcpu.sh takes no arguments (see --help)" >&2; exit 1 ;;
esac
# the paths made absolute before setup_env.sh changes to the repo root: relative ones are the caller's
export NANOCHAT_BASE_DIR="${NANOCHAT_BASE_DIR:-$HOME/.cache/nanochat}"
case "$NANOCHAT_BASE_DIR" in /*) ;; *) NANOCHAT_BASE_DIR="$PWD/$NANOCHAT_BASE_DIR" ;; esac
case "${EVAL_BUNDLE:-/}" in /*) ;; *) EVAL_BUNDLE="$PWD/$EVAL_BUNDLE" ;; esac
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(nproc 2>/dev/null || echo 2)}"
BASE="$NANOCHAT_BASE_DIR"
TARGET_FLOPS="${TARGET_FLOPS:-1e13}"   # per run; ~90 steps of 4096 tokens for the d4 model below
MAX_PER_TASK="${MAX_PER_TASK:-50}"
stage() { echo; echo "=== $* ==="; }

stage "data ($BASE/base_data)"
if ls "$BASE"/base_data/shard_*.parquet >/dev/null 2>&1; then
    echo "shards already present: $(ls "$BASE"/base_data/shard_*.parquet | wc -l)"
elif ! python -m nanochat.dataset -n 2; then
    echo "no network for ClimbMix: building the offline corpus from the Python standard library's docs"
    python -m nanochat.dataset --offline
fi

stage "tokenizer"
if [ -f "$BASE/tokenizer/tokenizer.pkl" ]; then
    echo "tokenizer already trained: $BASE/tokenizer"
else
    python -m scripts.tok_train --vocab-size 4096 --max-chars 20000000
fi
python -m scripts.tok_eval --max-chars 1000000

# The demo model, preset "demo" in scripts/presets.py: 4 blocks × 256, 256-token context, 4096 tokens per step,
# LRs raised against the tiny batch; for NAG a 10-step α warm-up and faster gate and temperature-gain LRs.
MODEL=(--preset demo --target-flops "$TARGET_FLOPS")

# --resume latest: a finished run is left alone, an interrupted one continues from its newest checkpoint
stage "train the GPT baseline"
python -m scripts.base_train --arch gpt --run cpu-gpt "${MODEL[@]}" --resume latest
stage "train NAG on the same FLOP budget and data order"
python -m scripts.base_train --arch nag --run cpu-nag "${MODEL[@]}" --resume latest

stage "evaluate (CORE on up to $MAX_PER_TASK items per task, bpb, samples)"
BUNDLE_ARGS=()  # default: the CORE bundle is downloaded once into the base dir
if [ -n "${EVAL_BUNDLE:-}" ]; then BUNDLE_ARGS=(--eval-bundle "$EVAL_BUNDLE"); fi
for arch in gpt nag; do
    if [ -f "$BASE/runs/cpu-$arch/eval.json" ]; then
        echo "cpu-$arch already evaluated"
    else
        python -m scripts.base_eval --run "cpu-$arch" --eval core,bpb,sample --max-per-task "$MAX_PER_TASK" \
            --split-tokens 65536 --device-batch-size 4 "${BUNDLE_ARGS[@]}"
    fi
done

stage "residual geometry, attention sinks, confidence (docs/analysis.md)"
python -m analysis cpu-gpt cpu-nag --tokens 65536

stage "comparison report"
python -m scripts.compare cpu-gpt cpu-nag --out "$NANOCHAT_BASE_DIR/reports/cpu-gpt_vs_cpu-nag"
