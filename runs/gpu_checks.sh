#!/usr/bin/env bash
# The measurements only a GPU can make (scripts/bench/gpu_checks.py has the stages, their time limits and the
# figures each writes). No network and no data: the benchmarks use random tokens.
#
#   bash runs/gpu_checks.sh --quick     # at most 8 minutes on one H100/H200, compiles included
#   bash runs/gpu_checks.sh             # also the published shape at full depth; CORE batching with EVAL_BUNDLE=DIR
#
# Output: $OUT when set (a device runner's folder that comes back), else --out DIR, else gpu_checks/:
# results.json (the machine and every finished stage's figures), summary.md (a line per stage as it ends, then the
# headline figures) and logs.tar.gz (the stages' logs): three files, each brought up to date as a stage ends.
# Without a GPU it stops at once with one line. The exit status is 1 if any stage failed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# 1. the Python: $PYTHON, else .venv, else the machine's python3 if it has what the checks import
#    (rustbpe is not needed), else make .venv (needs the network)
if [ -n "${PYTHON:-}" ]; then
    PY="$PYTHON"
elif [ -x .venv/bin/python ]; then
    PY=.venv/bin/python
elif python3 -c "import torch, triton, pyarrow, yaml, pytest, tiktoken" 2>/dev/null; then
    PY=python3
else
    source runs/setup_env.sh
    PY=python
fi

# 2. the checks
export PYTHONUNBUFFERED=1
exec "$PY" -m scripts.bench.gpu_checks "$@"
