#!/usr/bin/env bash
# Failure 2 (gate collapse) and its fixed twin, now part of runs/failures.sh (docs/failures.md).
#   bash runs/failure2_gate_collapse.sh --scale cpu     # same flags as runs/failures.sh
exec bash "$(dirname "${BASH_SOURCE[0]}")/failures.sh" "$@"
