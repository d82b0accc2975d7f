#!/usr/bin/env bash
# The test suite, self-contained: sets up .venv if needed, then runs pytest on CPU.
# Extra arguments go to pytest (e.g. `bash runs/test.sh -k tokenizer`; pytest's own: python -m pytest --help).
# It also installs the optional extras hf and track (their tests skip without them); NANOCHAT_EXTRAS= leaves them out.
set -euo pipefail
case "${1:-}" in -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; exit 0 ;; esac  # the comment above
NANOCHAT_EXTRAS="${NANOCHAT_EXTRAS-hf,track}"  # not exported: the scripts the tests start set up no extras
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
# two workers, one per core (pytest-xdist); the tests that start process groups of their own (torchrun, gloo ranks)
# form one group that runs one test at a time on one worker (tests/conftest.py), so no two groups ever share a port
python -m pytest -q -n 2 --dist loadgroup tests "$@"
