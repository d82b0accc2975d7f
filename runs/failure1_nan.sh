#!/usr/bin/env bash
# Failure 1 (NaN) and its fixed twin, now part of runs/failures.sh (docs/failures.md).
#   bash runs/failure1_nan.sh --scale cpu     # same flags as runs/failures.sh
exec bash "$(dirname "${BASH_SOURCE[0]}")/failures.sh" "$@"
