#!/usr/bin/env bash
# The paper's depth claim as a sweep (docs/failures.md §5): FLOP-matched arms (default GPT and NAG) at several
# depths, the width shrinking with depth so the blocks keep about the same number of parameters; val bpb of every
# run, each arm's gap to GPT against depth as a table and a plot.
#
#   bash runs/depth_sweep.sh --scale cpu                       # depths 2, 4, 8 of the CPU demo model, ~16 minutes
#   bash runs/depth_sweep.sh --scale cpu --seeds 1,2,3         # each pair per seed (sweep-gpt-d2-s1, ...): mean gaps
#   bash runs/depth_sweep.sh --scale published --dry-run       # depths 16 … 64 at the published size: the plan
#   bash runs/depth_sweep.sh --scale cpu --archs gpt,nag,gpt-recipe   # any arms of nag/archs.py, gpt among them
#   bash runs/depth_sweep.sh --scale published --gpus 8        # further flags go to speedrun.sh
#   bash runs/depth_sweep.sh --help                            # the flags (--base-dir DIR: relative to your cwd)
#
# A rerun reuses finished runs and evaluations and resumes an interrupted run from its newest checkpoint. A failed
# run is named at the end (exit status 1); the other runs, seeds and depths go on.
set -euo pipefail
# setup_env.sh changes to the repo root; relative paths are the caller's
export NANOCHAT_CALLER_CWD="${NANOCHAT_CALLER_CWD:-$PWD}"
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(nproc 2>/dev/null || echo 2)}"
python -m scripts.experiments.depth_sweep "$@"
