#!/usr/bin/env bash
# The test suite, self-contained: sets up .venv if needed, then runs pytest on CPU; then reruns the tests marked
# cpu_kind (fp8 matmuls, float comparisons that a CPU's kernels could break) as on a CPU capped at AVX2.
# Extra arguments go to pytest, in both runs (e.g. `bash runs/test.sh -k tokenizer`, which reruns no cpu_kind test;
# pytest's own: python -m pytest --help).
# It also installs the optional extras hf and track (their tests skip without them); NANOCHAT_EXTRAS= leaves them out.
set -euo pipefail
case "${1:-}" in -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; exit 0 ;; esac  # the comment above
NANOCHAT_EXTRAS="${NANOCHAT_EXTRAS-hf,track}"  # not exported: the scripts the tests start set up no extras
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
# two workers, one per core (pytest-xdist); the tests that start process groups of their own (torchrun, gloo ranks)
# form one group that runs one test at a time on one worker (tests/conftest.py), so no two groups ever share a port
python -m pytest -q -n 2 --dist loadgroup tests "$@"
# The same kernels every time would hide a CPU assumption until a user's CPU finds it. Capped at AVX2, oneDNN has no
# fp8 matmul (the fp8 tests must skip, --fp8 be refused in one line) and MKL sums in other orders. Not
# ATEN_CPU_CAPABILITY=avx2: torch then emulates fp8 matmuls instead of asking oneDNN. Seconds, most of it
# collection; exit 5 is pytest's "no test selected" (a -k that names none of them).
rc=0
ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 python -m pytest -q tests "$@" -m cpu_kind || rc=$?
[ "$rc" = 0 ] || [ "$rc" = 5 ] || exit "$rc"
