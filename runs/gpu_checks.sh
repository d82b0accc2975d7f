#!/usr/bin/env bash
# The measurements only a GPU can make (scripts/bench/gpu_checks.py has the stages, their time limits, expected times
# and the figures each writes). No network and no data: the benchmarks use random tokens (base_train: offline text).
#
#   bash runs/gpu_checks.sh --quick             # at most 7 minutes on one H100/H200, compiles included: GPT, NAG fused
#                                               # and NAG compiled, branch op, base_train against the bench, MoD
#                                               # compiled against full depth (bf16, fp8)
#   bash runs/gpu_checks.sh                     # also attention, MFU, cold compiles,
#                                               # per-block compile, full depth, MoD per block, base_train with fp8 and
#                                               # MoD; CORE batching with EVAL_BUNDLE=DIR
#   bash runs/gpu_checks.sh --quick --dry-run   # the plan and the files it writes; needs no GPU
#
# Output: $OUT when set (a device runner's folder that comes back), else --out DIR, else gpu_checks/:
# results.json (the machine and every stage's status and figures), summary.md (a line per stage as it ends, then the
# headline figures) and logs.tar.gz (the stages' logs): three files, each brought up to date as a stage ends.
# Without a GPU it stops at once with one line. The exit status is 1 if any stage failed (a skipped one has not).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# 1. the Python: $PYTHON, else .venv, else the machine's own python3 if it has torch and Triton (a borrowed GPU
#    slot: no .venv, no network, no rustbpe; what its python has is in docs/gpu_checks.md), else make .venv (network)
if [ -n "${PYTHON:-}" ]; then
    PY="$PYTHON"
elif [ -x .venv/bin/python ]; then
    PY=.venv/bin/python
elif python3 -c "import torch, triton" 2>/dev/null; then
    PY=python3
else
    source runs/setup_env.sh
    PY=python
fi

# 2. the checks
export PYTHONUNBUFFERED=1
exec "$PY" -m scripts.bench.gpu_checks "$@"
