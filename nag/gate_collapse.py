"""
Verdicts on the NAG failure cases (docs/failures.md), read from a run's metrics.jsonl.

Failure 2, gate collapse: a branch is shut when its mean modulator m, its gain as a share of its own ceiling α,
is below DEAD_MODULATOR (0.1). A run has collapsed when at least COLLAPSE_SHARE of its branches are shut at
mid-run and the same branches are still shut at the end: gates that slammed shut and never reopened.
"""

from nanochat.run_dir import rows_with
from nag.model import DEAD_MODULATOR

# The walkthrough saw "almost a quarter" of the updates shut; 0.2 accepts that with margin, while a healthy
# run sits at 0 (m starts at ≈ 0.5 everywhere, and the fixed run's telemetry stays far from 0.1).
COLLAPSE_SHARE = 0.2


def gate_rows(metrics_path):
    """The metrics.jsonl rows that carry gate telemetry, in step order (a restarted run's repeats: the last wins)."""
    return rows_with(metrics_path, "gate")


def shut(gate):
    return {b["name"] for b in gate["branches"] if b["m_mean"] < DEAD_MODULATOR}


def collapse_verdict(metrics_path, share=COLLAPSE_SHARE):
    """{"verdict": "collapsed" | "recovered" | "healthy" | "no telemetry", "share": branches shut from mid-run to
    the end / all branches, "mid_step", "end_step", "shut_mid", "shut_end"}. "recovered": enough branches were shut
    at mid-run, but too few of them still are at the end."""
    rows = gate_rows(metrics_path)
    if len(rows) < 2:
        return {"verdict": "no telemetry", "share": None}
    end = rows[-1]
    mid = next(r for r in rows if r["step"] >= end["step"] / 2)
    n = end["gate"]["num_branches"]
    shut_mid, shut_end = shut(mid["gate"]), shut(end["gate"])
    kept = len(shut_mid & shut_end) / n
    if kept >= share:
        verdict = "collapsed"
    elif len(shut_mid) / n >= share:
        verdict = "recovered"
    else:
        verdict = "healthy"
    return {
        "verdict": verdict,
        "share": kept,
        "mid_step": mid["step"],
        "end_step": end["step"],
        "shut_mid": len(shut_mid),
        "shut_end": len(shut_end),
        "num_branches": n,
    }
