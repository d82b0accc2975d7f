#!/usr/bin/env bash
# The published pair (runs/published_pair.sh) on a single GPU. The batch stays 2^20 tokens: 32 micro-batches
# of 16 × 2048 are accumulated per step, and the data loader's virtual shards give every micro-step the rows
# it would have had on 8 GPUs, so the steps, tokens, data order and (up to float noise) the results match
# the 8-GPU run. Expect ≈ 8× the wall time: ≈ 21 h of training per run at 40% MFU on an H100.
#
#   bash runs/published_pair_1gpu.sh --dry-run
#   bash runs/published_pair_1gpu.sh
#
# A run is resumed with the process count it was saved with: keep finishing a 1-GPU run on 1 GPU.
set -euo pipefail
# --help: the comment above, then speedrun.sh's flags
case "${1:-}" in -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; echo ;; esac
exec bash "$(dirname "${BASH_SOURCE[0]}")/../speedrun.sh" --preset published --arch gpt,nag --gpus 1 "$@"
