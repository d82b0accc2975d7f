#!/usr/bin/env bash
# The published FLOP-matched pair (docs/reproduce.md) on one 8×H100 node: the GPT baseline, then NAG (fixed),
# both 64 blocks × dim 640, 3e19 FLOPs, batch 2^20 tokens, the same data order; then CORE + bpb and a report.
#
#   bash runs/published_pair.sh --dry-run     # the plan first: 9,474 GPT steps, 9,425 NAG steps, disk, time
#   bash runs/published_pair.sh               # the real thing (≈ 2h40m of training per run at 40% MFU)
#
# What to expect at the end (docs/reproduce.md): GPT val bpb ≈ 0.750, CORE ≈ 0.222; NAG val bpb ≈ 0.759, CORE ≈ 0.237.
# NAG costs ≈ +40% step time unfused (the fused Triton kernels are the CUDA default).
# Extra arguments go to speedrun.sh (e.g. --base-dir DIR); base_train flags after a `--`.
# Interrupted? Run it again: finished stages are skipped and training resumes from the last checkpoint.
set -euo pipefail
# --help: the comment above, then speedrun.sh's flags
case "${1:-}" in -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; echo ;; esac
exec bash "$(dirname "${BASH_SOURCE[0]}")/../speedrun.sh" --preset published --arch gpt,nag --gpus 8 "$@"
