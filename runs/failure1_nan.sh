#!/usr/bin/env bash
# Failure 1 of the published run (docs/design.md §5), on purpose: NAG with the modulator floor removed.
# With --nag-mod-floor 0, a token whose every preferred-direction sigmoid underflows (u = 0 exactly: logits
# below about −89, in fp32 and bf16 alike), raised to a learned power β < 1, has the gradient β·u^(β−1) = inf,
# and the step is NaN. Expect the run to stop with one line, `error: non-finite ... at step N ...`, naming
# the NAG parameters with non-finite gradients: that is base_train's non-finite guard. This recipe removes
# only the floor; the walkthrough's NaN run also lacked the slow gate LR and the α warm-up, and with slow
# gates u may never reach exactly 0, so the NaN may not show.
#
#   bash runs/failure1_nan.sh            # published NAG config on 8 GPUs, run nag-published-fail1-nan
#   bash runs/failure1_nan.sh --gpus 1   # any further speedrun.sh flags (no `--` here)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
RUN=(bash speedrun.sh --preset published --arch nag --tag fail1-nan "$@" -- --nag-mod-floor 0)
if [[ " $* " == *" --dry-run "* ]]; then exec "${RUN[@]}"; fi  # the plan only
log=$(mktemp)
trap 'rm -f "$log"' EXIT
if "${RUN[@]}" 2>&1 | tee "$log"; then
    echo "failure 1 NOT reproduced: the run finished with finite losses and gradients"
    exit 1
fi
if grep -q "error: non-finite" "$log"; then
    echo "failure 1 reproduced: the non-finite guard stopped the run ($(grep -m1 'error: non-finite' "$log" | cut -c1-120)...)"
else
    echo "the run failed for another reason (see above), not the NaN of failure 1"
    exit 1
fi
