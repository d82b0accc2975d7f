#!/usr/bin/env bash
# Create (or reuse) .venv at the repo root with torch + the project installed, then check that torch
# sees the GPUs. Source it: `source runs/setup_env.sh`.
#
# Every package comes at the version requirements.lock pins (runs/lock.sh makes it from pyproject.toml); a venv made
# from an older lock is brought to the new one. torch is the lock's version everywhere, its build picked per machine:
#   - no GPU (nvidia-smi lists none): the CPU build (PyTorch's CPU index on Linux; PyPI's on macOS, or
#     where that index is unreachable: on Linux PyPI's is the large CUDA build, which also runs on a CPU);
#   - a GPU node whose driver is 580 or newer: PyPI's build (CUDA 13.0, which needs driver >= 580);
#   - an older driver (many rented H100 nodes run 550-575): the CUDA 12.8 build from PyTorch's index.
# NANOCHAT_TORCH_INDEX=URL picks another index (e.g. https://download.pytorch.org/whl/cu126).
# NANOCHAT_EXTRAS=hf,track also installs the optional extras (see below).
# `bash runs/setup_env.sh --help` prints this. Sourced, it reads no flags: the positional arguments are its caller's.
set -euo pipefail
if [ "${BASH_SOURCE[0]}" = "$0" ]; then  # run, not sourced
    case "${1:-}" in
        -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; exit 0 ;;
        ?*) echo "error: setup_env.sh takes no arguments (see --help)" >&2; exit 1 ;;
    esac
fi
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${NANOCHAT_VENV:-$REPO_ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
LOCK="$REPO_ROOT/requirements.lock"
TORCH="torch==$(sed -n 's/^torch==\([^ ;]*\).*/\1/p' "$LOCK")"
LOCK_STAMP="$VENV/.nanochat-lock"  # the sha256 of the lock this venv was installed from
LOCK_SHA="$("$PYTHON" -c "import hashlib, sys; print(hashlib.sha256(open(sys.argv[1], 'rb').read()).hexdigest())" "$LOCK")"
STALE=0; [ "$(cat "$LOCK_STAMP" 2>/dev/null)" = "$LOCK_SHA" ] || STALE=1
GPU_NODE=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then GPU_NODE=1; fi
if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup] creating virtual environment in $VENV"
    "$PYTHON" -m venv "$VENV"
fi
# the checks read package metadata and never import torch (seconds each): every recipe sources this file
if ! "$VENV/bin/python" -c "import sys, importlib.metadata as m; sys.exit(m.version('torch').split('+')[0] != sys.argv[1])" "${TORCH#torch==}" 2>/dev/null; then
    if [ "$GPU_NODE" = 1 ]; then
        DRIVER=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1)
        INDEX="${NANOCHAT_TORCH_INDEX:-}"
        if [ -z "$INDEX" ] && [ "${DRIVER%%.*}" -lt 580 ]; then INDEX="https://download.pytorch.org/whl/cu128"; fi
        echo "[setup] GPU found (driver $DRIVER): installing $TORCH from ${INDEX:-PyPI (CUDA 13.0 build)}"
        "$VENV/bin/pip" install -q "$TORCH" ${INDEX:+--index-url "$INDEX"}
    elif [ "$(uname -s)" = Linux ] && curl -sfI --max-time 5 https://download.pytorch.org/whl/cpu/ >/dev/null 2>&1; then
        echo "[setup] no GPU: installing the CPU build of $TORCH from PyTorch's CPU index"
        "$VENV/bin/pip" install -q "$TORCH" --index-url https://download.pytorch.org/whl/cpu
    else  # macOS (PyPI's build is the CPU/MPS one), or no route to PyTorch's index: PyPI or a local wheel
        echo "[setup] no GPU: installing $TORCH"
        "$VENV/bin/pip" install -q "$TORCH"
    fi
fi
# exits 0 when all the modules named are there
FOUND='import sys, importlib.util as u; sys.exit(any(u.find_spec(m) is None for m in sys.argv[1:]))'
if [ "$STALE" = 1 ] || ! "$VENV/bin/python" -c "$FOUND" nanochat tiktoken rustbpe pyarrow matplotlib pytest yaml 2>/dev/null; then
    echo "[setup] installing the project and its dependencies at requirements.lock's versions"
    "$VENV/bin/pip" install -q -c "$LOCK" -e "$REPO_ROOT[test]"
fi
# GPU nodes: the fast attention kernel, pyproject's gpu extra (flash-attn-4; with CUDA 13 torch, CUTLASS DSL's cu13
# libraries too), once. A failed install costs one line: --attn auto then times the kernels left (docs/design.md §2)
if [ "$GPU_NODE" = 1 ] && { [ "$STALE" = 1 ] || ! "$VENV/bin/python" -c "$FOUND" flash_attn.cute 2>/dev/null; }; then
    CU13=$("$VENV/bin/python" -c "import torch; print('nvidia-cutlass-dsl[cu13]' if (torch.version.cuda or '').startswith('13') else '')")
    echo "[setup] installing the gpu extra (flash-attn-4${CU13:+, $CU13})"
    "$VENV/bin/pip" install -q -c "$LOCK" -e "$REPO_ROOT[test,gpu]" $CU13 >/dev/null 2>&1 \
        || echo "[setup] could not install flash-attn-4 (no route to PyPI?): --attn auto uses cuDNN attention or SDPA instead"
fi
# optional extras (pyproject.toml, docs/interop.md), only when asked: NANOCHAT_EXTRAS=hf,track (any subset)
#   hf: transformers, safetensors, lm-eval (scripts.export_hf, lm_eval); track: tensorboard, wandb, trackio (--log-to)
# each is installed when one of its packages is missing or the lock changed, so a second run costs a look-up
EXTRAS_MISSING=""
for extra in $(echo "${NANOCHAT_EXTRAS:-}" | tr ',' ' '); do
    case "$extra" in
        hf) probe="transformers safetensors lm_eval accelerate" ;;
        track) probe="tensorboard wandb trackio" ;;
        *) echo "error: NANOCHAT_EXTRAS takes a comma-separated subset of hf,track, got '$NANOCHAT_EXTRAS'" >&2
           return 1 2>/dev/null || exit 1 ;;
    esac
    "$VENV/bin/python" -c "$FOUND" $probe \
        && [ "$STALE" = 0 ] || EXTRAS_MISSING="$EXTRAS_MISSING,$extra"
done
if [ -n "$EXTRAS_MISSING" ]; then
    echo "[setup] installing the optional extras ${EXTRAS_MISSING#,}"
    "$VENV/bin/pip" install -q -c "$LOCK" -e "$REPO_ROOT[test$EXTRAS_MISSING]" \
        || echo "[setup] could not install ${EXTRAS_MISSING#,} (no route to a package index?): their tests skip, the rest runs"
fi
echo "$LOCK_SHA" > "$LOCK_STAMP"  # the extras' install may have failed (no route): their tests skip, as they say
export PATH="$VENV/bin:$PATH"
export PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}"
cd "$REPO_ROOT"
# a GPU node whose torch cannot see its GPUs would train on the CPU: stop here, with one line
if [ "$GPU_NODE" = 1 ]; then python -m scripts.check_cuda; fi
