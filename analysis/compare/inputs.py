"""
What a report is made from, and the folder it goes into: inputs.json records each run's directory, evaluated
step and a hash of its evaluation files, so that a report of other inputs is never replaced unasked.
"""

import os
import json
import hashlib

from nanochat.common import UserError, get_base_dir
from nanochat.run_dir import EVAL_JSON, eval_files

INPUTS = "inputs.json"  # in the report folder: the inputs it was made from


def report_inputs(run_dirs):
    """What a report is made from: each run's directory, evaluated step and a hash of its evaluation files.
    A hash, not mtimes: a re-evaluation that gives the same numbers is the same input."""
    runs = []
    for run_dir in run_dirs:
        h, step = hashlib.sha256(), None
        for path in eval_files(run_dir):
            with open(path, "rb") as f:
                data = f.read()
            h.update(f"{os.path.relpath(path, run_dir)}\0{len(data)}\0".encode() + data)
            if os.path.basename(path) == EVAL_JSON:
                try:
                    step = json.loads(data).get("step")
                except (ValueError, AttributeError):
                    step = None
        runs.append({"dir": os.path.realpath(run_dir), "step": step, "eval_sha256": h.hexdigest()})
    return {"runs": runs}


def read_inputs(out_dir):
    """The inputs recorded in a report folder, or None (none recorded, or unreadable)."""
    try:
        with open(os.path.join(out_dir, INPUTS), encoding="utf-8") as f:
            old = json.load(f)
    except (OSError, ValueError):
        return None
    return old if isinstance(old, dict) else None


def report_is_current(out_dir, run_dirs):
    """Whether out_dir holds a report of these runs as they are evaluated now (speedrun skips the stage then)."""
    return os.path.isfile(os.path.join(out_dir, "report.md")) and read_inputs(out_dir) == report_inputs(run_dirs)


def distinct_names(runs):
    """Two runs of one name (from different base dirs) get distinct names: the names key columns and numbers."""
    seen = {}
    for r in runs:
        seen[r["name"]] = seen.get(r["name"], 0) + 1
        if seen[r["name"]] > 1:
            r["name"] = f"{r['name']}#{seen[r['name']]}"
    return runs


def run_step(run):
    """The step a run is compared at: its evaluated step, else the last one it logged."""
    ev = run["eval"] or {}
    return ev["step"] if isinstance(ev.get("step"), int) else run["metrics"][-1]["step"]


def default_out_dir(runs, base_dir=None):
    parts = [f"{r['name'].replace(os.sep, '_')}@{run_step(r)}" for r in runs]
    return os.path.join(base_dir or get_base_dir(), "reports", "_vs_".join(parts))


def check_report_folder(out_dir, inputs):
    """The default folder is named after the runs and steps only: refuse to replace a report of other inputs there."""
    if not os.path.exists(os.path.join(out_dir, "report.md")) and not os.path.exists(os.path.join(out_dir, INPUTS)):
        return
    old = read_inputs(out_dir)
    if old == inputs:
        return
    if old is None or len(old.get("runs") or []) != len(inputs["runs"]):
        what = "inputs not recorded" if old is None else "other runs"
    else:
        changes = []
        for o, n in zip(old["runs"], inputs["runs"]):
            if o.get("dir") != n["dir"]:
                changes.append(f"{o.get('dir')} where this is {n['dir']}")
            elif o != n:
                changes.append(f"an earlier evaluation of {n['dir']}")
        what = "; ".join(changes)
    raise UserError(f"{out_dir} holds a report of other inputs ({what}); pass --out DIR to write this one elsewhere, "
                    f"or --out {out_dir} to replace it")
