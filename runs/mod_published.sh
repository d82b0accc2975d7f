#!/usr/bin/env bash
# Mixture-of-Depths at the published scale on one 8-GPU node (docs/mod.md): NAG-MoD and the router GPT-MoD
# baseline at 20 %, on the published pair's budget (3e19 FLOPs, iso-FLOP: MoD buys more steps), then bpb,
# NAG's inference curve if the full-depth published NAG run exists, and a report with the published pair.
#
#   bash runs/mod_published.sh --dry-run    # the two plans (steps, tokens, FLOPs per token); no data, no GPU
#   bash runs/mod_published.sh              # the real thing, after runs/published_pair.sh
#
# torch.compile is off: MoD's executed-token counts are data-dependent shapes.
# Settings are environment variables: RATE (0.2), GPUS (8), NANOCHAT_BASE_DIR (a relative path is taken from
# the directory you run it in). --help prints this.
set -euo pipefail
case "${1:-}" in  # --help prints the comment above
    -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; exit 0 ;;
    ""|--dry-run) ;;
    *) echo "error: unknown argument $1 (mod_published.sh takes only --dry-run; see --help)" >&2; exit 1 ;;
esac
export NANOCHAT_BASE_DIR="${NANOCHAT_BASE_DIR:-$HOME/.cache/nanochat}"
# before the cd: a relative base dir is the caller's
case "$NANOCHAT_BASE_DIR" in /*) ;; *) NANOCHAT_BASE_DIR="$PWD/$NANOCHAT_BASE_DIR" ;; esac
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source runs/setup_env.sh
RATE="${RATE:-0.2}"
GPUS="${GPUS:-8}"
TAG="$(awk "BEGIN { print int($RATE * 100 + 0.5) }")"   # 0.2 → 20
MOD=(--mod-rate "$RATE" --mod-blocks both)
if [ "${1:-}" = "--dry-run" ]; then
    python -m scripts.base_train --preset published --arch nag "${MOD[@]}" --run "nag-mod$TAG" --dry-run "$GPUS"
    python -m scripts.base_train --preset published --arch gpt-router "${MOD[@]}" --run "gpt-router$TAG" --dry-run "$GPUS"
    exit 0
fi
T=(torchrun --standalone --nproc_per_node="$GPUS")
"${T[@]}" -m scripts.base_train -- --preset published --arch nag "${MOD[@]}" --run "nag-mod$TAG" --resume latest
"${T[@]}" -m scripts.base_train -- --preset published --arch gpt-router "${MOD[@]}" --run "gpt-router$TAG" --resume latest
for run in "nag-mod$TAG" "gpt-router$TAG"; do
    "${T[@]}" -m scripts.base_eval -- --run "$run" --eval core,bpb --split-tokens $((80 * 2 ** 19))
done
BASE="$NANOCHAT_BASE_DIR"
if [ -d "$BASE/runs/nag-published" ]; then
    "${T[@]}" -m scripts.base_eval -- --run nag-published --eval bpb --mod-rate 0.05,0.1,0.2,0.3,0.4 --mod-blocks both
    python -m scripts.compare gpt-published nag-published "nag-mod$TAG" "gpt-router$TAG"
else
    python -m scripts.compare "nag-mod$TAG" "gpt-router$TAG"
fi
