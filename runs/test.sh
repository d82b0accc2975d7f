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
# The same kernels every time would hide a CPU assumption until a user's CPU finds it: rerun the cpu_kind tests with
# torch's, oneDNN's and MKL's AVX2 code (other vector widths, other summation orders). Inductor's cache key ignores
# ATEN_CPU_CAPABILITY (kernels cached under another one gave wrong values here), hence a cache of its own. Seconds,
# most of it collection; exit 5 is pytest's "no test selected" (a -k that names none of them).
rc=0
ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
    TORCHINDUCTOR_CACHE_DIR="${TMPDIR:-/tmp}/nanochat-inductor-avx2" python -m pytest -q tests "$@" -m cpu_kind || rc=$?
[ "$rc" = 0 ] || [ "$rc" = 5 ] || exit "$rc"
