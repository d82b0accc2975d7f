#!/usr/bin/env bash
# nanochat's recipe at toy scale on a CPU, in minutes, with no network needed: the recipe baseline (gpt-recipe: value
# embeddings, smear, backout, resid / x0 lambdas) against NAG on the same recipe (nag-recipe), FLOP-matched, then
# CORE + bpb and the comparison with intervals (docs/design.md §10). The same stages as runs/runcpu.sh, on its demo
# model (preset "demo": 4 blocks × 256, 256-token context, 4096 tokens per step, 1e13 FLOPs per run).
#
#   bash runs/recipe_cpu.sh                 # everything under ~/.cache/nanochat (or $NANOCHAT_BASE_DIR)
#   EVAL_BUNDLE=/path/to/eval_bundle bash runs/recipe_cpu.sh    # a local copy of the CORE bundle (no download)
#   RECIPE_FLAGS="--no-smear" bash runs/recipe_cpu.sh           # an ablation: both runs without smear (named -no-smear)
#
# No flags (--help prints this); settings are environment variables: NANOCHAT_BASE_DIR, EVAL_BUNDLE (relative paths
# are taken from the directory you run it in), TARGET_FLOPS, MAX_PER_TASK, RECIPE_FLAGS. It shares the data and the
# tokenizer with runs/runcpu.sh, so after that one only the two runs, their evaluation and the report are new.
# Re-running skips what is already done and continues an interrupted run from its newest complete checkpoint.
set -euo pipefail
case "${1:-}" in  # --help prints the comment above
    -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; exit 0 ;;
    ?*) echo "error: recipe_cpu.sh takes no arguments (see --help)" >&2; exit 1 ;;
esac
export NANOCHAT_BASE_DIR="${NANOCHAT_BASE_DIR:-$HOME/.cache/nanochat}"
case "$NANOCHAT_BASE_DIR" in /*) ;; *) NANOCHAT_BASE_DIR="$PWD/$NANOCHAT_BASE_DIR" ;; esac
case "${EVAL_BUNDLE:-/}" in /*) ;; *) EVAL_BUNDLE="$PWD/$EVAL_BUNDLE" ;; esac
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(nproc 2>/dev/null || echo 2)}"
BASE="$NANOCHAT_BASE_DIR"
TARGET_FLOPS="${TARGET_FLOPS:-1e13}"   # per run: the same budget for both, so the pair is FLOP-matched
MAX_PER_TASK="${MAX_PER_TASK:-50}"
read -r -a FLAGS <<< "${RECIPE_FLAGS:-}"
TAG="$(echo "${RECIPE_FLAGS:-}" | tr -s ' ' '-' | sed 's/^-*//; s/-*$//; s/--*/-/g')"
SFX="${TAG:+-$TAG}"
stage() { echo; echo "=== [$(date +%H:%M:%S)] $* ==="; }

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

GPT="cpu-gpt-recipe$SFX"
NAG="cpu-nag-recipe$SFX"
FAILED=()
stage "train the recipe baseline $GPT, then NAG on the recipe $NAG, on the same FLOP budget and data order"
python -m scripts.base_train --arch gpt-recipe --run "$GPT" --preset demo --target-flops "$TARGET_FLOPS" "${FLAGS[@]}" --resume latest \
    || FAILED+=("$GPT")
python -m scripts.base_train --arch nag-recipe --run "$NAG" --preset demo --target-flops "$TARGET_FLOPS" "${FLAGS[@]}" --resume latest \
    || FAILED+=("$NAG")

stage "evaluate (CORE on up to $MAX_PER_TASK items per task, bpb, samples)"
BUNDLE_ARGS=()
if [ -n "${EVAL_BUNDLE:-}" ]; then BUNDLE_ARGS=(--eval-bundle "$EVAL_BUNDLE"); fi
for run in "$GPT" "$NAG"; do  # --skip-done: what eval.json already holds at these settings is kept, the rest measured
    python -m scripts.base_eval --run "$run" --eval core,bpb,sample --max-per-task "$MAX_PER_TASK" \
        --split-tokens 65536 --device-batch-size 4 --skip-done "${BUNDLE_ARGS[@]}" || FAILED+=("eval $run")
done

stage "comparison report"
python -m scripts.compare "$GPT" "$NAG" --out "$BASE/reports/${GPT}_vs_${NAG}" || FAILED+=("report")
if [ "${#FAILED[@]}" -gt 0 ]; then echo "error: failed: ${FAILED[*]} (rerun to retry them; finished runs are reused)" >&2; exit 1; fi
