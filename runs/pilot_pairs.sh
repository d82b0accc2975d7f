#!/usr/bin/env bash
# runs/pilot_pairs.sh: the walkthrough's pilot pairs (docs/reproduce.md, "The pilot pairs"). GPT and NAG at depth
# 26 × 640, FLOP-matched at 1e18, then at 3e18 FLOPs, on the GPUs here (planned for 2 × RTX 5090 when there are
# none). Each pair ends in its report; the walkthrough's NAG - GPT val bpb gaps were 0.038 and 0.016. Flags go to
# both speedrun commands (e.g. --dry-run, --gpus 2); rerunning skips what is done.
set -euo pipefail
cd "$(dirname "$0")/.."
# --help: the comment above, then speedrun.sh's flags
case "${1:-}" in -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; exec bash speedrun.sh --help ;; esac

# 1. the 1e18 pair: gpt-pilot-1e18, nag-pilot-1e18
bash speedrun.sh --preset pilot --flops 1e18 "$@"

# 2. the 3e18 pair: gpt-pilot-3e18, nag-pilot-3e18
bash speedrun.sh --preset pilot --flops 3e18 "$@"
