#!/usr/bin/env bash
# Regenerate requirements.lock, the exact version of every package setup_env.sh installs (the project, its test
# tools, the hf / track / gpu extras), resolved from pyproject.toml by uv for Python >= 3.11 on every platform.
#   bash runs/lock.sh                           keep every pin that still satisfies pyproject.toml (add what is new)
#   bash runs/lock.sh --upgrade                 move every package to its newest release
#   bash runs/lock.sh --upgrade-package numpy   move one
#   NANOCHAT_LOCK_TORCH=2.14.1 bash runs/lock.sh --upgrade-package torch   another torch (setup_env installs the lock's)
# Extra arguments go to `uv pip compile`. Needs the network to PyPI; uv is installed in a throwaway venv.
# setup_env.sh installs with the lock as pip constraints (-c), so a package only an extra needs is pinned but not
# installed unless that extra is asked for; torch's build (CPU / CUDA 13.0 / CUDA 12.8) is still picked per machine.
set -euo pipefail
case "${1:-}" in -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; exit 0 ;; esac
cd "$(dirname "${BASH_SOURCE[0]}")/.."
TORCH_VERSION="${NANOCHAT_LOCK_TORCH:-$(sed -n 's/^torch==\([^ ;]*\).*/\1/p' requirements.lock 2>/dev/null || true)}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"  # the first lock's; later ones keep theirs
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
python3 -m venv "$TMP/uv"
"$TMP/uv/bin/pip" install -q uv
echo "torch==$TORCH_VERSION" > "$TMP/torch.txt"
"$TMP/uv/bin/uv" pip compile --quiet pyproject.toml --all-extras --universal --python-version 3.11 \
    --constraint "$TMP/torch.txt" --custom-compile-command "bash runs/lock.sh" -o requirements.lock "$@"
echo "requirements.lock: $(grep -c '==' requirements.lock) packages, torch $TORCH_VERSION"
