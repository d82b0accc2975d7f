#!/usr/bin/env bash
# speedrun.sh: the FLOP-matched GPT vs NAG comparison on GPU nodes, from a fresh machine to a report.
#
#   bash speedrun.sh                          the published pair (docs/reproduce.md) on every visible GPU
#   bash speedrun.sh --dry-run                the plan only: no GPU, no network, nothing written
#   bash speedrun.sh --preset d20 --arch nag  one nanochat-d20-like run
#   bash speedrun.sh --preset run6            nanochat's record recipe (Run 6, d24) vs NAG on that recipe, FLOP-matched
#   bash speedrun.sh --preset demo            the CPU demo's pair (runs/runcpu.sh's model) through the GPU pipeline
#   bash speedrun.sh --preset tiny            CPU smoke test of the whole pipeline (offline corpus, minutes)
#   bash speedrun.sh --seeds 1,2,3            the pair once per seed (gpt-published-s1, ...), compared as groups
#   bash speedrun.sh --arch nag --tag nofloor -- --nag-mod-floor 0    anything after -- goes to base_train
#   bash speedrun.sh --nnodes 2 --node-rank R --rdzv-endpoint HOST:PORT    on each of two nodes
#                                             (docs/runs.md; SLURM: runs/slurm_pair.sbatch)
#   bash speedrun.sh --help                   the flags
#
# Flags: --preset published|run6|d20|demo|tiny, --arch gpt,nag, --flops X, --gpus N, --tag T (default: derived from
# the flags after --), --seeds 1,2,3, --nnodes N, --node-rank R, --rdzv-endpoint HOST:PORT, --max-restarts K,
# --base-dir DIR, --shards N, --offline, --eval-bundle DIR, --dry-run.
# Relative paths are taken from the directory you run it in.
# Rerunning skips what is done: present shards, a trained tokenizer, finished runs (base_train
# --resume latest continues an unfinished one), up-to-date evaluations and report. A run that fails is
# named at the end (exit status 1) and the other runs go on; the next rerun retries it.
set -euo pipefail
# relative paths in the flags are the caller's, not the repo's
export NANOCHAT_CALLER_CWD="${NANOCHAT_CALLER_CWD:-$PWD}"
# one srun task per node (runs/slurm_pair.sbatch) is not a rank: speedrun starts its own processes
unset SLURM_STEP_NUM_TASKS
cd "$(dirname "${BASH_SOURCE[0]}")"
stage() { echo; echo "=== [$(date +%H:%M:%S)] $* ==="; }

# 1. environment and plan: flags checked, steps / tokens / FLOPs / disk / time printed, stage status
source runs/setup_env.sh
# the plan as data: scripts.speedrun writes plain quoted assignments (BASE, PRESET, DRY_RUN, the *_DONE flags, the
# runs) to PLAN_FILE, which is sourced, never run as generated code; --help leaves it empty: nothing more to do
PLAN_FILE=$(mktemp "${TMPDIR:-/tmp}/speedrun-plan.XXXXXX")
trap 'rm -f "$PLAN_FILE"' EXIT
python -m scripts.speedrun --plan-file "$PLAN_FILE" "$@"
if [ ! -s "$PLAN_FILE" ]; then exit 0; fi
source "$PLAN_FILE"
if [ "$DRY_RUN" = 1 ]; then echo "dry run: nothing was started"; exit 0; fi
export NANOCHAT_BASE_DIR="$BASE"
mkdir -p "$BASE"
exec > >(tee -a "$BASE/$LOG") 2>&1  # speedrun.log (node 0), speedrun-node<R>.log (the other nodes)

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

# 5. training: run RUNS[i] of arch RUN_ARCH[i]; for each seed GPT, then NAG (then any other arch), on the same FLOP
#    budget (FLOPS: --flops), GPU plan (MEMORY: --gpu, --gpu-memory, and one device batch for all runs where the
#    memory plan would pick two) and data order. The user's base_train flags (EXTRA: those after --) come after the
#    preset's, the seed's flags (RUN_SEED_ARGS: as the plan made them) and the run's name last. A finished run is a
#    no-op; a failed one is named at the end, and the others go on.
FAILED=()
for i in "${!RUNS[@]}"; do
    if [ "${TRAIN_DONE[$i]}" = 1 ]; then continue; fi
    stage "train ${RUNS[$i]}"
    read -r -a SEED <<< "${RUN_SEED_ARGS[$i]}"
    if "${LAUNCH[@]}" scripts.base_train -- --preset "$PRESET" --arch "${RUN_ARCH[$i]}" "${FLOPS[@]}" "${MEMORY[@]}" \
        "${EXTRA[@]}" "${SEED[@]}" --run "${RUNS[$i]}" --resume latest
    then TRAIN_DONE[$i]=1; else FAILED+=("${RUNS[$i]}"); fi
done

# 6. evaluation: CORE, bpb, samples, of every run that trained (EVAL_PRESET: the preset's base_eval flags; BUNDLE:
#    --eval-bundle)
for i in "${!RUNS[@]}"; do
    if [ "${EVAL_DONE[$i]}" = 1 ]; then continue; fi
    stage "evaluate ${RUNS[$i]}"
    if [ "${TRAIN_DONE[$i]}" = 0 ]; then echo "skipped: its training failed"
    elif "${EVAL_LAUNCH[@]}" scripts.base_eval -- --run "${RUNS[$i]}" --eval core,bpb,sample "${EVAL_PRESET[@]}" "${BUNDLE[@]}"
    then EVAL_DONE[$i]=1; else FAILED+=("eval ${RUNS[$i]}"); fi
done

# 7. with both archs: residual geometry, attention sinks, confidence (docs/analysis.md) of the first seed's pair
#    (RUNS[0], RUNS[1]), then the report of every run
#    (COMPARE_RUNS: the pair, or with several seeds --a GPT's --b NAG's)
evaluated() { for i in "$@"; do if [ "${EVAL_DONE[$i]}" = 0 ]; then return 1; fi; done; }
if [ "$PAIR" = 1 ]; then
    stage "analyse ${RUNS[0]} vs ${RUNS[1]}"
    if [ "$ANALYSIS_DONE" = 1 ]; then echo "analysis already up to date, skipping"
    elif ! evaluated 0 1; then echo "skipped: needs both ${RUNS[0]} and ${RUNS[1]} evaluated"
    elif ! python -m analysis "${RUNS[0]}" "${RUNS[1]}" "${ANALYSIS[@]}"; then FAILED+=("analysis")
    fi
    stage "compare: $REPORT"
    if [ "$REPORT_DONE" = 1 ]; then echo "report already up to date, skipping"
    elif ! evaluated "${!RUNS[@]}"; then echo "skipped: needs every run evaluated"
    elif ! python -m scripts.compare "${COMPARE_RUNS[@]}" --out "$REPORT"; then FAILED+=("report")
    fi
fi
if [ "${#FAILED[@]}" -gt 0 ]; then echo "error: failed: ${FAILED[*]} (rerun to retry them; finished runs are reused)" >&2; exit 1; fi
stage "done (log: $BASE/$LOG)"
