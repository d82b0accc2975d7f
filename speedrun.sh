#!/usr/bin/env bash
# speedrun.sh: the FLOP-matched GPT vs NAG comparison on one GPU node, from a fresh machine to a report.
#
#   bash speedrun.sh                          the published pair (docs/reproduce.md) on every visible GPU
#   bash speedrun.sh --dry-run                the plan only: no GPU, no network, nothing written
#   bash speedrun.sh --preset d20 --arch nag  one nanochat-d20-like run
#   bash speedrun.sh --preset tiny            CPU smoke test of the whole pipeline (offline corpus, minutes)
#   bash speedrun.sh --arch nag --tag nofloor -- --nag-mod-floor 0    anything after -- goes to base_train
#   bash speedrun.sh --help                   the flags
#
# Flags: --preset published|d20|tiny, --arch gpt,nag, --flops X, --gpus N, --tag T (default: derived from
# the flags after --), --base-dir DIR, --shards N, --offline, --eval-bundle DIR, --dry-run. Relative paths
# are taken from the directory you run it in.
# Rerunning skips what is done: present shards, a trained tokenizer, finished runs (base_train
# --resume latest continues an unfinished one), up-to-date evaluations and report.
set -euo pipefail
export NANOCHAT_CALLER_CWD="${NANOCHAT_CALLER_CWD:-$PWD}"  # relative paths in the flags are the caller's, not the repo's
cd "$(dirname "${BASH_SOURCE[0]}")"
stage() { echo; echo "=== [$(date +%H:%M:%S)] $* ==="; }

# 1. environment and plan: flags checked, steps / tokens / FLOPs / disk / time printed, stage status
source runs/setup_env.sh
PLAN=$(python -m scripts.speedrun "$@")  # shell assignments: BASE, DRY_RUN, the *_DONE flags, the stage commands (--help: exit 0)
eval "$PLAN"
if [ "$DRY_RUN" = 1 ]; then echo "dry run: nothing was started"; exit 0; fi
export NANOCHAT_BASE_DIR="$BASE"
mkdir -p "$BASE"
exec > >(tee -a "$BASE/speedrun.log") 2>&1

# 2. the fused NAG kernel against the reference on this GPU (seconds), before hours of GPT training
if [ "$PREFLIGHT" = 1 ]; then
    stage "preflight: fused NAG kernel vs reference"
    python -m pytest -q -x tests/test_nag_kernels.py -k cuda --require-cuda  # fails if no CUDA test ran
fi

# 3. data: the tokenizer's shards now, the rest in the background while it trains
stage "data ($BASE/base_data)"
DL_PID=""
if [ "$DATA_DONE" = 1 ]; then echo "data already present, skipping"
elif [ "$OFFLINE" = 1 ]; then python -m nanochat.dataset --offline
else
    python -m nanochat.dataset -n "$TOK_SHARDS"
    python -m nanochat.dataset -n "$SHARDS" > "$BASE/download.log" 2>&1 &
    DL_PID=$!
fi

# 4. tokenizer
stage "tokenizer"
if [ "$TOK_DONE" = 1 ]; then echo "tokenizer already trained, skipping"
else
    python -m scripts.tok_train --vocab-size "$VOCAB" --max-chars "$TOK_CHARS"
    python -m scripts.tok_eval --max-chars 1000000
fi
if [ -n "$DL_PID" ]; then stage "waiting for the ClimbMix download"; wait "$DL_PID"; fi

# 5. training: GPT, then NAG, on the same FLOP budget and data order (a finished run is a no-op)
if [ "$GPT_TRAIN_DONE" = 0 ]; then stage "train $GPT_RUN"; "${LAUNCH[@]}" scripts.base_train -- "${GPT_TRAIN[@]}"; fi
if [ "$NAG_TRAIN_DONE" = 0 ]; then stage "train $NAG_RUN"; "${LAUNCH[@]}" scripts.base_train -- "${NAG_TRAIN[@]}"; fi

# 6. evaluation: CORE, bpb, samples
if [ "$GPT_EVAL_DONE" = 0 ]; then stage "evaluate $GPT_RUN"; "${LAUNCH[@]}" scripts.base_eval -- "${GPT_EVAL[@]}"; fi
if [ "$NAG_EVAL_DONE" = 0 ]; then stage "evaluate $NAG_RUN"; "${LAUNCH[@]}" scripts.base_eval -- "${NAG_EVAL[@]}"; fi

# 7. residual geometry, attention sinks, confidence (docs/analysis.md), then the report; both need both runs
PAIR=0; if [ -f "$BASE/runs/$GPT_RUN/eval.json" ] && [ -f "$BASE/runs/$NAG_RUN/eval.json" ]; then PAIR=1; fi
stage "analyse $GPT_RUN vs $NAG_RUN"
if [ "$ANALYSIS_DONE" = 1 ]; then echo "analysis already up to date, skipping"
elif [ "$PAIR" = 1 ]; then python -m analysis "$GPT_RUN" "$NAG_RUN" "${ANALYSIS[@]}"
else echo "skipped: needs both $GPT_RUN and $NAG_RUN evaluated"
fi
stage "compare $GPT_RUN vs $NAG_RUN"
if [ "$REPORT_DONE" = 1 ]; then echo "report already up to date, skipping"
elif [ "$PAIR" = 1 ]; then python -m scripts.compare "$GPT_RUN" "$NAG_RUN" --out "$BASE/reports/${GPT_RUN}_vs_${NAG_RUN}"
else echo "skipped: needs eval.json of both $GPT_RUN and $NAG_RUN"
fi
stage "done (log: $BASE/speedrun.log)"
