#!/usr/bin/env bash
# The whole pipeline at toy scale on a CPU, in minutes, with no network needed:
# environment → corpus → tokenizer → a FLOP-matched GPT / NAG pair → CORE + bpb → analysis → comparison report.
#
#   bash runs/runcpu.sh                 # everything under ~/.cache/nanochat (or $NANOCHAT_BASE_DIR)
#   EVAL_BUNDLE=/path/to/eval_bundle bash runs/runcpu.sh    # a local copy of the CORE bundle (no download)
#   SEEDS=1,2,3 bash runs/runcpu.sh     # each arch once per seed (cpu-gpt-s1, cpu-nag-s1, ...), compared as groups
#
# No flags (--help prints this); settings are environment variables: NANOCHAT_BASE_DIR, EVAL_BUNDLE (relative
# paths are taken from the directory you run it in), TARGET_FLOPS, MAX_PER_TASK, SEEDS. With SEEDS, seed s sets the
# init and the data order of its runs (nanochat.common.seed_flags), so the GPT and NAG runs of one seed share both.
# Re-running skips what is already done (data, tokenizer, finished runs, what eval.json holds whole at these
# settings) and continues an interrupted run from its newest complete checkpoint or CORE from its first task not scored.
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
# SEEDS by the one seed-list rule (nanochat.common.parse_seeds, as speedrun.sh's --seeds): different integers, 1,2,3
if [ -n "${SEEDS:-}" ]; then
    python -c 'import sys; from nanochat.common import exit_on_user_error as one_line, parse_seeds
with one_line(): parse_seeds(sys.argv[1], "SEEDS")' "$SEEDS"
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(nproc 2>/dev/null || echo 2)}"
BASE="$NANOCHAT_BASE_DIR"
TARGET_FLOPS="${TARGET_FLOPS:-1e13}"   # per run; ~90 steps of 4096 tokens for the d4 model below
MAX_PER_TASK="${MAX_PER_TASK:-50}"
stage() { echo; echo "=== [$(date +%H:%M:%S)] $* ==="; }  # the clock: how long each stage took, on this machine

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

# The demo model, preset "demo" in nag/presets.py: 4 blocks × 256, 256-token context, 4096 tokens per step,
# LRs raised against the tiny batch; for NAG a 10-step α warm-up and faster gate and temperature-gain LRs.
MODEL=(--preset demo --target-flops "$TARGET_FLOPS")

# one pair (cpu-gpt, cpu-nag), or with SEEDS one pair per seed, named -s<seed>
SUFFIXES=("")
if [ -n "${SEEDS:-}" ]; then SUFFIXES=(); for seed in ${SEEDS//,/ }; do SUFFIXES+=("-s$seed"); done; fi
# the base_train flags of a suffix's seed: the experiments' one rule (nanochat.common.seed_flags), none without SEEDS
seed_args() {
    if [ -n "$1" ]; then python -c 'import sys; from nanochat.common import seed_flags
print(*seed_flags(int(sys.argv[1])))' "${1#-s}"; fi
}
FAILED=()  # a failed run is reported at the end; the other seeds go on

# --resume latest: a finished run is left alone, an interrupted one continues from its newest checkpoint
for sfx in "${SUFFIXES[@]}"; do
    read -r -a SEED <<< "$(seed_args "$sfx")"
    stage "train the GPT baseline cpu-gpt$sfx, then NAG on the same FLOP budget and data order"
    for arch in gpt nag; do
        python -m scripts.base_train --arch "$arch" --run "cpu-$arch$sfx" "${MODEL[@]}" "${SEED[@]}" --resume latest \
            || FAILED+=("cpu-$arch$sfx")
    done
done

stage "evaluate (CORE on up to $MAX_PER_TASK items per task, bpb, samples)"
BUNDLE_ARGS=()  # default: the CORE bundle is downloaded once into the base dir
if [ -n "${EVAL_BUNDLE:-}" ]; then BUNDLE_ARGS=(--eval-bundle "$EVAL_BUNDLE"); fi
# --skip-done: what a run's results already hold at these settings is kept (base_eval decides from their content:
# an offline CORE is tried again once a bundle can be had, an interrupted one resumed), the rest measured
for sfx in "${SUFFIXES[@]}"; do
    for arch in gpt nag; do
        python -m scripts.base_eval --run "cpu-$arch$sfx" --eval core,bpb,sample --skip-done \
            --max-per-task "$MAX_PER_TASK" --split-tokens 65536 --device-batch-size 4 "${BUNDLE_ARGS[@]}" \
            || FAILED+=("eval cpu-$arch$sfx")
    done
done

FIRST="${SUFFIXES[0]}"
stage "residual geometry, attention sinks, confidence (docs/analysis.md) of cpu-gpt$FIRST and cpu-nag$FIRST"
python -m analysis "cpu-gpt$FIRST" "cpu-nag$FIRST" --tokens 65536 || FAILED+=("analysis")

stage "comparison report"
if [ -z "${SEEDS:-}" ]; then
    python -m scripts.compare cpu-gpt cpu-nag --out "$BASE/reports/cpu-gpt_vs_cpu-nag" || FAILED+=("report")
else  # the groups: both training noise (seeds) and evaluation noise in the interval
    python -m scripts.compare --a "${SUFFIXES[@]/#/cpu-gpt}" --b "${SUFFIXES[@]/#/cpu-nag}" --out "$BASE/reports/cpu-seeds-${SEEDS//,/-}" \
        || FAILED+=("report")
fi
# to every digit, then against the expected ones within tolerances (docs/runs.md, "What reproducible means"); other
# runs or settings (SEEDS, TARGET_FLOPS) are "not applicable" and another MAX_PER_TASK's CORE is not compared: no
# false mismatch
stage "the four figures, against runs/runcpu_expected.json"
python -c 'import sys; from nanochat.common import exit_on_user_error as one_line
from nanochat.demo_check import check_expected
with one_line(): print("\n".join(check_expected(sys.argv[2:], sys.argv[1])))' \
    runs/runcpu_expected.json "${SUFFIXES[@]/#/cpu-gpt}" "${SUFFIXES[@]/#/cpu-nag}" || FAILED+=("figures")
if [ "${#FAILED[@]}" -gt 0 ]; then echo "error: failed: ${FAILED[*]} (rerun to retry them; finished runs are reused)" >&2; exit 1; fi
