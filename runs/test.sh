#!/usr/bin/env bash
# The test suite, self-contained: sets up .venv if needed, then runs pytest on CPU.
# Extra arguments go to pytest (e.g. `bash runs/test.sh -k tokenizer`).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
python -m pytest -q tests "$@"
