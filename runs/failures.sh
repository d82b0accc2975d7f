#!/usr/bin/env bash
# NAG's two published failure cases, each beside its fixed twin, with a verdict table (docs/failures.md):
# failure 1 (NaN: floor 0, gate LR = matrix LR, no α warm-up; twin: the floor back) and failure 2 (gate
# collapse: gate LR = matrix LR, no α warm-up; twin: gate LR = matrix / 12 and the warm-up).
#
#   bash runs/failures.sh --scale cpu                          # tiny runs on a CPU (data + tokenizer as runcpu.sh)
#   bash runs/failures.sh --scale cpu --seeds 1,2,3
#   bash runs/failures.sh --scale cpu --dry-run                # the CPU runs and their status; nothing is trained
#   bash runs/failures.sh --scale published --dry-run          # the four published-scale plans (speedrun.sh)
#   bash runs/failures.sh --scale published --gpus 8           # further flags go to speedrun.sh
#   bash runs/failures.sh --help                               # the flags (--base-dir DIR: relative to your cwd)
#
# A rerun reuses finished runs and resumes an interrupted one from its newest checkpoint.
set -euo pipefail
# setup_env.sh changes to the repo root; relative paths are the caller's
export NANOCHAT_CALLER_CWD="${NANOCHAT_CALLER_CWD:-$PWD}"
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(nproc 2>/dev/null || echo 2)}"
python -m scripts.experiments.failures "$@"
