#!/usr/bin/env bash
# Failure 2 of the published run (docs/design.md §5, the "broken" NAG row of docs/reproduce.md), on purpose: the gates trained at
# Muon's LR (--nag-gate-lr 0.012 instead of 1e-3) and no α warm-up (--nag-alpha-warmup-tokens 0).
# The gates slam shut: the realised gain α·m of many branches drops to ~0 and never recovers.
# Watch the telemetry line base_train prints every 100 steps,
#     gates | dead K/128 (mean |g| < ...) | |g| by depth quartile ...
# K climbs and stays high, unlike the fixed run's. The run itself finishes; the walkthrough reports for it
# val bpb ≈ 0.786 and CORE ≈ 0.201 (fixed NAG: 0.759 / 0.237; GPT: 0.750 / 0.222). When gpt-published has
# been evaluated (runs/published_pair.sh), the report compares against it.
#
#   bash runs/failure2_gate_collapse.sh                  # full 3e19 FLOPs on 8 GPUs, run nag-published-fail2-collapse
#   bash runs/failure2_gate_collapse.sh --flops 3e18     # a 10× cheaper look at the telemetry (final numbers not comparable)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash speedrun.sh --preset published --arch nag --tag fail2-collapse "$@" -- --nag-gate-lr 0.012 --nag-alpha-warmup-tokens 0
if [[ " $* " == *" --dry-run "* ]]; then exit 0; fi

# Dead branches over training, from the gate telemetry in metrics.jsonl (speedrun.sh has set up .venv).
BASE="${NANOCHAT_BASE_DIR:-$HOME/.cache/nanochat}"
args=("$@")
for i in "${!args[@]}"; do
    if [ "${args[i]}" = --base-dir ]; then BASE=${args[i + 1]}; fi
done
.venv/bin/python - "$BASE/runs/nag-published-fail2-collapse/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"gate"' in l]
picked = rows[:: max(1, len(rows) // 12)]
for r in picked + rows[-1:] * (picked[-1:] != rows[-1:]):  # about 12 rows, the last one always
    g = r["gate"]
    print(f"step {r['step']:>6}: dead branches {g['dead_branches']:>3}/{g['num_branches']} | |g| by depth quartile "
          + " ".join(f"{v:.3f}" for v in g["gain_by_depth_quartile"]))
PY
