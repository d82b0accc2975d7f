#!/usr/bin/env bash
# Create (or reuse) .venv at the repo root with torch + the project installed.
# Source it: `source runs/setup_env.sh`. A GPU node (nvidia-smi sees a GPU) gets a
# CUDA build of torch; any other machine gets the CPU build of torch 2.13.0.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${NANOCHAT_VENV:-$REPO_ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup] creating virtual environment in $VENV"
    "$PYTHON" -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        echo "[setup] GPU found: installing a CUDA build of torch"
        "$VENV/bin/pip" install -q "torch>=2.9"
    else
        echo "[setup] no GPU: installing the CPU build of torch 2.13.0"
        "$VENV/bin/pip" install -q "torch==2.13.0"
    fi
fi
if ! "$VENV/bin/python" -c "import nanochat, tiktoken, rustbpe, pyarrow, matplotlib, pytest" 2>/dev/null; then
    echo "[setup] installing the project and its dependencies"
    "$VENV/bin/pip" install -q -e "$REPO_ROOT[test]"
fi
export PATH="$VENV/bin:$PATH"
export PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}"
cd "$REPO_ROOT"
