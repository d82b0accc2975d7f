#!/usr/bin/env bash
# speedrun.sh: the FLOP-matched GPT vs NAG comparison on one GPU node, from a fresh machine to a report.
# Stages: environment → ClimbMix shards (the first few in the foreground, the rest in the background
# while the tokenizer trains) → tokenizer → train GPT, then NAG (same FLOP budget, same data order)
# → base_eval of each (CORE, bpb, samples) → scripts/compare.py report.
#
#   bash speedrun.sh                          the published pair (DESIGN §4) on every visible GPU
#   bash speedrun.sh --dry-run                the plan only: no GPU, no network, nothing written
#   bash speedrun.sh --preset d20 --arch nag  one nanochat-d20-like run
#   bash speedrun.sh --preset tiny            CPU smoke test of the whole pipeline (offline corpus, minutes)
#   bash speedrun.sh --arch nag --tag nan -- --nag-mod-floor 0    anything after -- goes to base_train
#
# Flags:
#   --preset published|d20|tiny  published: 64 blocks × dim 640, 3e19 FLOPs, batch 2^20 (default);
#                               d20: depth 20, dim 1280, budget from the 10.5 tokens/param rule;
#                               tiny: a 2-layer model on CPU, offline corpus, vocab 512
#   --arch gpt,nag     which runs (default both; GPT first)     --flops X    override the FLOP budget
#   --gpus N           processes (default: nvidia-smi's count; 8 in --dry-run without GPUs; 1 for tiny)
#   --tag T            run names become <arch>-<preset>-T (keeps experiments apart from the pair)
#   --base-dir DIR     everything goes here (default $NANOCHAT_BASE_DIR or ~/.cache/nanochat)
#   --shards N         ClimbMix train shards to download (default: from the budget, see ASSUMPTIONS)
#   --offline          build the offline corpus instead of downloading ClimbMix (also NANOCHAT_OFFLINE=1)
#   --eval-bundle DIR  local CORE bundle (default: downloaded once into the base dir)
#   --wandb on|off     recorded and exported as NANOCHAT_WANDB; this repo has no wandb dependency
#   --dry-run          validate, plan, estimate disk and time, then stop
#
# Re-running skips finished stages (data present, tokenizer present, runs whose final checkpoint
# exists, eval.json newer than that checkpoint) and resumes an unfinished run from its last checkpoint.
# The log goes to $BASE/speedrun.log (the background download's to $BASE/download.log).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$REPO"

# ASSUMPTIONS (estimates, not measurements):
# - a ClimbMix shard holds ~250M characters ≈ 55M tokens of a 32K-vocab tokenizer (400B tokens / 6,543 shards ≈ 61M)
#   and takes ~100 MB on disk; 20% more shards than the tokens trained on cover the text that
#   BOS-aligned packing crops away. The tokenizer trains on 2B characters: the first 8 shards.
TOKENS_PER_SHARD=55000000
SHARD_MB=100
DATA_MARGIN=1.2
TOK_SHARDS=8
# - wall time at 40% MFU of an H100's 989 TFLOP/s dense bf16 (evaluation not included)
MFU="${SPEEDRUN_MFU:-0.40}"
PEAK_FLOPS=989e12

die() { echo "error: $*" >&2; exit 1; }
stage() { echo; echo "=== [$(date +%H:%M:%S)] $* ==="; }
TMP="" DL_PID=""
cleanup() {  # on any exit: our temp dir, and the background download if it is still going
    if [ -n "$TMP" ]; then rm -rf "$TMP"; fi
    if [ -n "$DL_PID" ] && kill -0 "$DL_PID" 2>/dev/null; then echo "stopping the background download"; kill "$DL_PID"; fi
}
trap cleanup EXIT

# ---------------------------------------------------------------- flags
PRESET=published ARCHS=gpt,nag FLOPS="" GPUS="" TAG="" SHARDS="" EVAL_BUNDLE="" WANDB=off DRY=0
OFFLINE="${NANOCHAT_OFFLINE:-0}"
BASE="${NANOCHAT_BASE_DIR:-$HOME/.cache/nanochat}"
EXTRA=()
while [ $# -gt 0 ]; do
    case "$1" in --?*=*) set -- "${1%%=*}" "${1#*=}" "${@:2}" ;; esac  # --flag=value → --flag value
    case "$1" in
        --preset|--arch|--flops|--gpus|--tag|--base-dir|--shards|--eval-bundle|--wandb)
            [ $# -ge 2 ] || die "$1 needs a value" ;;
    esac
    case "$1" in
        --preset) PRESET=$2; shift 2 ;;
        --arch) ARCHS=$2; shift 2 ;;
        --flops) FLOPS=$2; shift 2 ;;
        --gpus) GPUS=$2; shift 2 ;;
        --tag) TAG=$2; shift 2 ;;
        --base-dir) BASE=$2; shift 2 ;;
        --shards) SHARDS=$2; shift 2 ;;
        --eval-bundle) EVAL_BUNDLE=$(cd "$2" 2>/dev/null && pwd) || die "--eval-bundle $2 is not a directory"; shift 2 ;;
        --wandb) WANDB=$2; shift 2 ;;
        --offline) OFFLINE=1; shift ;;
        --dry-run) DRY=1; shift ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        --) shift; EXTRA=("$@"); break ;;
        *) die "unknown argument '$1' (base_train flags go after --; see --help)" ;;
    esac
done

case "$PRESET" in published|d20|tiny) ;; *) die "unknown preset '$PRESET' (expected published, d20 or tiny)" ;; esac
RUN_ARCHS=()
for a in gpt nag; do  # GPT first, whatever the order given
    if [[ ",$ARCHS," == *",$a,"* ]]; then RUN_ARCHS+=("$a"); fi
done
for a in ${ARCHS//,/ }; do
    [[ "$a" == gpt || "$a" == nag ]] || die "unknown arch '$a' in --arch $ARCHS (expected gpt, nag or gpt,nag)"
done
[ ${#RUN_ARCHS[@]} -gt 0 ] || die "--arch is empty (expected gpt, nag or gpt,nag)"
[ -z "$GPUS" ] || [[ "$GPUS" =~ ^[1-9][0-9]*$ ]] || die "--gpus must be a positive integer, got '$GPUS'"
[ -z "$SHARDS" ] || [[ "$SHARDS" =~ ^[1-9][0-9]*$ ]] || die "--shards must be a positive integer, got '$SHARDS'"
[ -z "$FLOPS" ] || { [[ "$FLOPS" =~ ^[0-9]+(\.[0-9]*)?([eE][+-]?[0-9]+)?$ ]] && awk "BEGIN { exit !($FLOPS > 0) }"; } \
    || die "--flops must be a positive number like 3e19, got '$FLOPS'"
[[ "$WANDB" == on || "$WANDB" == off ]] || die "--wandb must be on or off, got '$WANDB'"
[[ -z "$TAG" || "$TAG" =~ ^[A-Za-z0-9._-]+$ ]] || die "--tag may hold only letters, digits, '.', '_' and '-', got '$TAG'"
[[ "$BASE" == /* ]] || BASE="$PWD/$BASE"
export NANOCHAT_BASE_DIR="$BASE" NANOCHAT_WANDB="$WANDB"

# ---------------------------------------------------------------- presets
# Every preset keeps base_train's DESIGN §2 rules: LRs × √(batch/2^19), AdamW LRs × (d/768)^-½.
SAVE_EVERY=-1 DEVICE=() EVAL_ARGS=() TOKEVAL_ARGS=() NAG=()
ANALYSIS_ARGS=(--tokens 1048576)  # python -m analysis of the pair (docs/analysis.md)
case "$PRESET" in
    published)  # DESIGN §4: 64 blocks × 640, 5 heads × 128, seq 2048, 3e19 FLOPs, batch 2^20, unscaled published LRs
        MODEL=(--depth 64 --model-dim 640 --head-dim 128 --max-seq-len 2048 --window-pattern L
               --target-flops 3e19 --total-batch-size 1048576 --device-batch-size 16
               --warmup-steps 40 --warmdown-ratio 0.65 --final-lr-frac 0.05
               --matrix-lr 0.012 --muon-momentum 0.95 --embedding-lr 0.18 --unembedding-lr 0.006)
        NAG=(--nag-gate-lr 1e-3 --nag-temp-gain-lr 0.005)
        SAVE_EVERY=2000 VOCAB=32768 TOK_CHARS=2000000000 ;;
    d20)  # nanochat-d20-like: dim 1280, 10 heads × 128, batch and horizon from the 10.5 tokens/param rule
        MODEL=(--depth 20 --aspect-ratio 64 --head-dim 128 --max-seq-len 2048 --window-pattern L --device-batch-size 32)
        SAVE_EVERY=1000 VOCAB=32768 TOK_CHARS=2000000000 ;;
    tiny)  # CPU smoke test: 2 layers × 64, 256 tokens per step, LRs raised against the tiny-batch LR scale
        MODEL=(--depth 2 --model-dim 64 --head-dim 32 --max-seq-len 64 --device-batch-size 4 --total-batch-size 256
               --target-flops 2e10 --warmup-steps 2 --matrix-lr 0.5 --embedding-lr 2.0 --unembedding-lr 0.1
               --eval-every 20 --eval-tokens 512)
        NAG=(--nag-alpha-warmup-tokens 1024 --nag-gate-log-every 10)
        DEVICE=(--device-type cpu)
        EVAL_ARGS=(--max-per-task 8 --split-tokens 512 --device-batch-size 4 --sample-tokens 8)
        TOKEVAL_ARGS=(--max-chars 200000)
        ANALYSIS_ARGS=(--tokens 1024 --clusters 4 --state-sample 64 --device-batch-size 4 --device cpu)
        SAVE_EVERY=20 VOCAB=512 TOK_CHARS=2000000 OFFLINE=1 GPUS=${GPUS:-1} ;;
esac
MODEL+=(--save-every "$SAVE_EVERY")
for ((i = 0; i < ${#EXTRA[@]}; i++)); do  # a --save-every after -- changes the checkpoint estimate too
    case "${EXTRA[i]}" in
        --save-every) SAVE_EVERY=${EXTRA[i + 1]:-$SAVE_EVERY} ;;
        --save-every=*) SAVE_EVERY=${EXTRA[i]#*=} ;;
    esac
done

run_name() { echo "$1-$PRESET${TAG:+-$TAG}"; }
set_args() {  # ARGS = the base_train arguments of arch $1 (our --run last, so it wins)
    ARGS=("${MODEL[@]}" "${DEVICE[@]}")
    if [ "$1" = nag ]; then ARGS+=("${NAG[@]}"); fi
    if [ -n "$FLOPS" ]; then ARGS+=(--target-flops "$FLOPS"); fi
    ARGS+=("${EXTRA[@]}" --arch "$1" --run "$(run_name "$1")")
}

# ---------------------------------------------------------------- GPUs
HAVE_GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
if [ -z "$GPUS" ]; then
    if [ "$HAVE_GPUS" -gt 0 ]; then GPUS=$HAVE_GPUS
    elif [ "$DRY" = 1 ]; then GPUS=8; echo "no nvidia-smi GPUs here: planning for 8"
    else die "no NVIDIA GPU found (nvidia-smi); see the plan with --dry-run, or smoke-test on CPU with --preset tiny"
    fi
fi

# ---------------------------------------------------------------- environment
if [ "$DRY" = 0 ]; then  # (a dry run writes nothing)
    mkdir -p "$BASE" 2>/dev/null || die "cannot create the base dir $BASE"
    exec > >(tee -a "$BASE/speedrun.log") 2>&1
    stage "environment (runs/setup_env.sh)"
    source runs/setup_env.sh
    PY=python
    if [ "$PRESET" != tiny ]; then export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"; fi
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
elif python3 -c "import torch" 2>/dev/null; then PY=python3
else source runs/setup_env.sh; PY=python
fi
echo "speedrun: preset $PRESET | arch ${RUN_ARCHS[*]} | $GPUS process(es) | base dir $BASE | wandb $WANDB" \
     "(no wandb integration here: metrics go to runs/<run>/metrics.jsonl)${EXTRA[*]:+ | base_train extras: ${EXTRA[*]}}"

# ---------------------------------------------------------------- plan (every mode: bad budgets fail here, before any GPU time)
stage "plan (base_train --dry-run $GPUS)"
[ -f "$BASE/tokenizer/tokenizer.pkl" ] && PLAN_VOCAB=0 || PLAN_VOCAB=$VOCAB  # 0 = the trained tokenizer's vocab
TMP=$(mktemp -d)
PIDS=() PLANS=()
for a in "${RUN_ARCHS[@]}"; do  # both archs at once: each is mostly the torch import
    set_args "$a"
    "$PY" -m scripts.base_train "${ARGS[@]}" --dry-run "$GPUS" --dry-run-vocab "$PLAN_VOCAB" >"$TMP/$a" 2>&1 &
    PIDS+=($!)
done
RCS=()
for pid in "${PIDS[@]}"; do wait "$pid" && RCS+=(0) || RCS+=(1); done
for i in "${!RUN_ARCHS[@]}"; do
    a=${RUN_ARCHS[i]}
    [ "${RCS[i]}" = 0 ] || die "planning $(run_name "$a"): $(grep . "$TMP/$a" | tail -1 | sed 's/^error: //')"
    PLANS+=("$(sed -n 's/^PLAN //p' "$TMP/$a")")
    grep -v '^PLAN ' "$TMP/$a" || true
done

# Totals, disk and time from the PLAN lines; writes shell variables (SHARDS, STEPS_*, CKPT_MB_*) to $PLAN_ENV.
PLAN_ENV=$TMP/plan.env
GPUS=$GPUS SHARDS=$SHARDS OFFLINE=$OFFLINE SAVE_EVERY=$SAVE_EVERY MFU=$MFU PEAK_FLOPS=$PEAK_FLOPS PRESET=$PRESET \
TOKENS_PER_SHARD=$TOKENS_PER_SHARD SHARD_MB=$SHARD_MB DATA_MARGIN=$DATA_MARGIN TOK_SHARDS=$TOK_SHARDS \
"$PY" - "$PLAN_ENV" "${PLANS[@]}" <<'PY'
import json, math, os, sys
E = os.environ
plans = [json.loads(p) for p in sys.argv[2:]]
gpus, save_every, mfu, peak = int(E["GPUS"]), int(E["SAVE_EVERY"]), float(E["MFU"]), float(E["PEAK_FLOPS"])
hms = lambda s: f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"
print(f"{'run':<24}{'params':>14}{'FLOPs/token':>16}{'steps':>9}{'tokens':>17}{'total FLOPs':>13}  {'checkpoints':<22}est. time")
env, total_s, total_ckpt = [], 0.0, 0.0
for p in plans:
    steps = p["num_iterations"]
    saves = steps // save_every + (steps % save_every > 0) if save_every > 0 else 1
    # checkpoint_gib = model + optimizer state; the optimizer is replicated, so rank 0 alone saves it
    per_save = p["checkpoint_gib"]
    secs = p["total_flops"] / (gpus * peak * mfu)
    total_s += secs
    total_ckpt += saves * per_save
    when = "CPU: minutes" if E["PRESET"] == "tiny" else f"{hms(secs)} at {mfu:.0%} MFU"
    print(f"{p['run']:<24}{p['num_params']:>14,}{p['flops_per_token']:>16,}{steps:>9,}{p['total_tokens']:>17,}"
          f"{p['total_flops']:>13.4e}  {f'{saves} × {per_save:.3g} GiB':<22}{when}")
    env += [f"STEPS_{p['arch']}={steps}", f"CKPT_MB_{p['arch']}={math.ceil(saves * per_save * 1024)}"]
tokens = max(p["total_tokens"] for p in plans)
if E["OFFLINE"] == "1":
    shards, data = 0, "offline corpus (python -m nanochat.dataset --offline), no download"
else:
    shards = int(E["SHARDS"] or max(int(E["TOK_SHARDS"]), math.ceil(tokens * float(E["DATA_MARGIN"]) / int(E["TOKENS_PER_SHARD"]))))
    data = (f"{shards} ClimbMix train shards + 1 val shard ≈ {(shards + 1) * int(E['SHARD_MB']) / 1024:.1f} GiB "
            f"(assuming ~{int(E['TOKENS_PER_SHARD']) / 1e6:.0f}M tokens, ~{E['SHARD_MB']} MB per shard, "
            f"+{float(E['DATA_MARGIN']) - 1:.0%} for packing; {tokens:,} tokens trained)")
env += [f"SHARDS={shards}"]
print(f"data: {data}")
print(f"checkpoints: {total_ckpt:.1f} GiB in all (a save every {save_every} steps + the last one; "
      f"optimizer state saved once by rank 0)")
if E["PRESET"] != "tiny":
    print(f"training time: ≈ {hms(total_s)} on {gpus} × H100 at {mfu:.0%} MFU of 989 TFLOP/s "
          f"(+ evaluation; unfused NAG runs ~40% slower per step, DESIGN §4)")
open(sys.argv[1], "w").write("\n".join(env) + "\n")
PY
source "$PLAN_ENV"

# ---------------------------------------------------------------- what is done already
shard_file() { printf '%s/base_data/shard_%05d.parquet' "$BASE" "$1"; }
data_done() {
    if [ "$OFFLINE" = 1 ]; then ls "$BASE"/base_data/shard_*.parquet >/dev/null 2>&1; return; fi
    [ -f "$(shard_file 6542)" ] || return 1  # the validation shard
    local i
    for ((i = 0; i < SHARDS; i++)); do [ -f "$(shard_file "$i")" ] || return 1; done
}
tok_done() { [ -f "$BASE/tokenizer/tokenizer.pkl" ] && [ -f "$BASE/tokenizer/token_bytes.pt" ]; }
steps_of() { local v="STEPS_$1"; echo "${!v}"; }
final_ckpt() { printf '%s/runs/%s/model_%06d.pt' "$BASE" "$(run_name "$1")" "$(steps_of "$1")"; }
run_done() { [ -f "$(final_ckpt "$1")" ]; }
eval_done() { local e="$BASE/runs/$(run_name "$1")/eval.json"; [ -f "$e" ] && [ "$e" -nt "$(final_ckpt "$1")" ]; }
last_step() {  # the newest complete checkpoint (meta_*.json is written last)
    ls "$BASE/runs/$1"/meta_*.json 2>/dev/null | sed 's/.*meta_0*\([0-9][0-9]*\)\.json$/\1/' | sort -n | tail -1 || true
}
report_done() {
    local r="$BASE/reports/${GPT_RUN}_vs_${NAG_RUN}/report.md" g="$BASE/runs/$GPT_RUN/eval.json" n="$BASE/runs/$NAG_RUN/eval.json"
    [ -f "$r" ] && [ "$r" -nt "$g" ] && [ "$r" -nt "$n" ]
}
analysis_done() {
    local a="$BASE/reports/analysis_${GPT_RUN}_vs_${NAG_RUN}/analysis.json" g="$BASE/runs/$GPT_RUN/eval.json" n="$BASE/runs/$NAG_RUN/eval.json"
    [ -f "$a" ] && [ "$a" -nt "$g" ] && [ "$a" -nt "$n" ]
}
status() { if "$@"; then echo "done, skip"; else echo "to do"; fi; }

# Disk: what is still to download plus the checkpoints of unfinished runs, against df on the base dir.
NEED_MB=0
if [ "$OFFLINE" = 0 ] && ! data_done; then NEED_MB=$(( (SHARDS + 1) * SHARD_MB )); fi
for a in "${RUN_ARCHS[@]}"; do
    v="CKPT_MB_$a"
    if ! run_done "$a"; then NEED_MB=$(( NEED_MB + ${!v} )); fi
done
d=$BASE; while [ ! -d "$d" ]; do d=$(dirname "$d"); done  # df needs a directory that exists
FREE_MB=$(( $(df -Pk "$d" | awk 'NR == 2 {print $4}') / 1024 ))
echo "disk: need ≈ $(( NEED_MB / 1024 )) GiB more in $BASE, $(( FREE_MB / 1024 )) GiB free$( [ "$NEED_MB" -le "$FREE_MB" ] || echo " (NOT ENOUGH: a real run stops here)")"

GPT_RUN=gpt-$PRESET NAG_RUN=nag-$PRESET  # a single-arch invocation is compared against the untagged partner
for a in "${RUN_ARCHS[@]}"; do if [ "$a" = gpt ]; then GPT_RUN=$(run_name gpt); else NAG_RUN=$(run_name nag); fi; done
line() { printf '  %-11s %-62s %s\n' "$@"; }
echo "stages:"
line environment "runs/setup_env.sh" ""
if [ "$OFFLINE" = 1 ]; then line data "offline corpus (nanochat.dataset --offline)" "[$(status data_done)]"
else line data "ClimbMix: $TOK_SHARDS shards, then up to $SHARDS in the background" "[$(status data_done)]"; fi
line tokenizer "vocab $VOCAB on up to $TOK_CHARS characters" "[$(status tok_done)]"
for a in "${RUN_ARCHS[@]}"; do line train "$(run_name "$a"): $(steps_of "$a") steps" "[$(status run_done "$a")]"; done
for a in "${RUN_ARCHS[@]}"; do line evaluate "$(run_name "$a"): CORE, bpb, samples" "[$(status eval_done "$a")]"; done
line analysis "$GPT_RUN vs $NAG_RUN: geometry, attention sinks, confidence" "[$(status analysis_done)]"
line compare "$GPT_RUN vs $NAG_RUN (once both are evaluated)" "[$(status report_done)]"

if [ "$DRY" = 1 ]; then
    echo; echo "dry run: nothing was started"
    exit 0
fi
[ "$NEED_MB" -le "$FREE_MB" ] || die "not enough disk in $BASE: need ≈ $(( NEED_MB / 1024 )) GiB, $(( FREE_MB / 1024 )) GiB free (see --dry-run)"
if [ "$PRESET" != tiny ] && [ "$HAVE_GPUS" -lt "$GPUS" ]; then
    die "asked for $GPUS GPU(s) but nvidia-smi sees $HAVE_GPUS; pass --gpus N, or use --preset tiny on CPU"
fi

launch() {  # $1 = module, the rest its arguments; torchrun for more than one process (the -- is required)
    local mod=$1; shift
    if [ "$GPUS" -gt 1 ]; then torchrun --standalone --nproc_per_node="$GPUS" -m "$mod" -- "$@"
    else python -m "$mod" "$@"; fi
}

# ---------------------------------------------------------------- preflight
# The NAG run defaults to the fused Triton kernel on CUDA: check it against the reference on this GPU
# (seconds) before hours of GPT training, rather than discover a problem when the NAG run starts.
if [ "$PRESET" != tiny ] && [[ " ${RUN_ARCHS[*]} " == *" nag "* ]] && [[ " ${EXTRA[*]} " != *"--nag-impl"* ]]; then
    stage "preflight: fused NAG kernel vs reference on this GPU"
    python -m pytest -q -x tests/test_nag_kernels.py -k cuda \
        || die "the fused NAG kernel failed its CUDA check (above); run with '-- --nag-impl compiled' (or reference) to train NAG without it"
fi

# ---------------------------------------------------------------- data + tokenizer
stage "data ($BASE/base_data)"
if data_done; then
    echo "data already present, skipping"
elif [ "$OFFLINE" = 1 ]; then
    python -m nanochat.dataset --offline
else
    echo "downloading the first $TOK_SHARDS shards (+ the val shard) for the tokenizer"
    python -m nanochat.dataset -n "$(( SHARDS < TOK_SHARDS ? SHARDS : TOK_SHARDS ))"
    echo "downloading the rest of the $SHARDS shards in the background (log: $BASE/download.log)"
    python -m nanochat.dataset -n "$SHARDS" >"$BASE/download.log" 2>&1 &
    DL_PID=$!
fi

stage "tokenizer"
if tok_done; then
    echo "tokenizer already trained ($BASE/tokenizer), skipping"
else
    python -m scripts.tok_train --vocab-size "$VOCAB" --max-chars "$TOK_CHARS"
    python -m scripts.tok_eval "${TOKEVAL_ARGS[@]}"
fi

if [ -n "$DL_PID" ]; then
    stage "waiting for the ClimbMix download"  # both runs must see the same shards: train only once all are in
    wait "$DL_PID" || die "the background download failed: $(grep . "$BASE/download.log" | tail -1)"
    DL_PID=""
    echo "all $SHARDS shards present"
fi

# ---------------------------------------------------------------- training
train_run() {  # $1 = arch: train, resume, or skip
    local run dir last
    run=$(run_name "$1") dir="$BASE/runs/$(run_name "$1")"
    set_args "$1"
    if run_done "$1"; then echo "$run already trained ($(steps_of "$1") steps), skipping"; return; fi
    last=$(last_step "$run")
    if [ -n "$last" ]; then
        echo "resuming $run from step $last of $(steps_of "$1")"
        launch scripts.base_train "${ARGS[@]}" --resume-from-step "$last"
    else
        if [ -d "$dir" ]; then echo "$run never reached a checkpoint: starting it again"; rm -rf "$dir"; fi
        launch scripts.base_train "${ARGS[@]}"
    fi
}
for a in "${RUN_ARCHS[@]}"; do
    stage "train $(run_name "$a") (same FLOP budget and data order for both archs)"
    train_run "$a"
done

# ---------------------------------------------------------------- evaluation + report
for a in "${RUN_ARCHS[@]}"; do
    stage "evaluate $(run_name "$a"): CORE, bpb, samples"
    if eval_done "$a"; then
        echo "$(run_name "$a") already evaluated, skipping"
    else
        launch scripts.base_eval --run "$(run_name "$a")" --eval core,bpb,sample "${EVAL_ARGS[@]}" "${DEVICE[@]}" \
            ${EVAL_BUNDLE:+--eval-bundle "$EVAL_BUNDLE"}
    fi
done

stage "analyse $GPT_RUN vs $NAG_RUN: residual geometry, attention sinks, confidence"
if analysis_done; then
    echo "analysis already up to date ($BASE/reports/analysis_${GPT_RUN}_vs_${NAG_RUN}), skipping"
elif [ -f "$BASE/runs/$GPT_RUN/eval.json" ] && [ -f "$BASE/runs/$NAG_RUN/eval.json" ]; then
    python -m analysis "$GPT_RUN" "$NAG_RUN" "${ANALYSIS_ARGS[@]}"
else
    echo "skipped: needs both $GPT_RUN and $NAG_RUN trained and evaluated"
fi

stage "compare $GPT_RUN vs $NAG_RUN"
if report_done; then
    echo "report already up to date ($BASE/reports/${GPT_RUN}_vs_${NAG_RUN}), skipping"
elif [ -f "$BASE/runs/$GPT_RUN/eval.json" ] && [ -f "$BASE/runs/$NAG_RUN/eval.json" ]; then
    python -m scripts.compare "$GPT_RUN" "$NAG_RUN"
else
    echo "skipped: needs eval.json of both $GPT_RUN and $NAG_RUN"
fi
stage "done (log: $BASE/speedrun.log)"
