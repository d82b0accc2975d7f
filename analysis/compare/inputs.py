"""
What a report is made from, and the folder it goes into.

Its manifest, inputs.json (nanochat/run_dir.py), records
each run's directory, evaluated step and a hash of its evaluation files, the report's own settings and the files
it wrote, so that a report of other inputs is never replaced unasked and a user's files are never touched.
"""

import os
import hashlib

from nanochat.common import UserError, get_base_dir
from nanochat.run_dir import CONFIG, eval_files, read_eval, read_manifest, folder_name, earlier_version

TOOL = "scripts.compare"  # the manifest's tool: a folder this command wrote


def report_inputs(run_dirs):
    """What a report is made from: each run's directory, evaluated step and a hash of its evaluation files.
    A hash, not mtimes: a re-evaluation that gives the same numbers is the same input."""
    runs = []
    for run_dir in run_dirs:
        h = hashlib.sha256()
        for path in eval_files(run_dir):
            with open(path, "rb") as f:
                data = f.read()
            h.update(f"{os.path.relpath(path, run_dir)}\0{len(data)}\0".encode() + data)
        step = (read_eval(run_dir) or {}).get("step")
        runs.append({"dir": os.path.realpath(run_dir), "step": step, "eval_sha256": h.hexdigest()})
    return {"runs": runs}


def read_inputs(out_dir):
    """The inputs recorded in a report folder, or None (none recorded, unreadable, or another tool's folder)."""
    m = read_manifest(out_dir)
    return m["inputs"] if m is not None and m["tool"] == TOOL and isinstance(m["inputs"], dict) else None


def report_is_current(out_dir, run_dirs):
    """Whether out_dir holds a report of these runs as they are evaluated now (speedrun skips the stage then)."""
    old = read_inputs(out_dir)
    return (
        os.path.isfile(os.path.join(out_dir, "report.md"))
        and old is not None
        and old.get("runs") == report_inputs(run_dirs)["runs"]
    )


def repeated_run(runs):
    """The first run given a second time (the same directory, however named), or None."""
    seen = set()
    for r in runs:
        d = os.path.realpath(r["dir"])
        if d in seen:
            return r
        seen.add(d)
    return None


def check_distinct(runs):
    """A run given twice compares it with itself: every delta 0, every interval empty. Refused in one line."""
    r = repeated_run(runs)
    if r is not None:
        raise UserError(
            f"`{r['name']}` is compared with itself ({r['dir']}): give two different runs"
            if len(runs) == 2
            else f"`{r['name']}` is given twice ({r['dir']}): give each run once"
        )


# config.json's compute_dtype, as a report says it
DTYPE_NAMES = {"bfloat16": "bf16", "float16": "fp16", "float32": "float32"}


def precision(run):
    """What a run's matmuls trained in, from what it recorded: "fp8" where any layer did (config.json's fp8_layers),
    else its compute dtype ("bf16" on a GPU, "float32" on a CPU). A --fp8 run whose size rule admitted no layer (a tiny
    model) trained in its compute dtype, and is named so."""
    cfg = run["config"]
    layers, dtype = cfg.get("fp8_layers"), cfg.get("compute_dtype")
    if not (isinstance(layers, int) and isinstance(dtype, str)):
        raise earlier_version(
            os.path.join(run["dir"], CONFIG),
            "a run's config without its fp8 layers and compute dtype",
            "compare it with the version that trained it",
        )
    return "fp8" if layers > 0 else DTYPE_NAMES.get(dtype, dtype)


def check_precision(runs, mixed):
    """Runs of other precisions (an fp8 arm against a bf16 one, a float32 CPU run against a bf16 GPU one) measure the
    precision with the architecture: refused unless asked (mixed)."""
    kinds = {precision(r) for r in runs}
    if len(kinds) > 1 and not mixed:
        first = next((r for r in runs if precision(r) == "fp8"), runs[0])
        other = next(r for r in runs if precision(r) != precision(first))
        how = "with fp8 matmuls (--fp8)" if precision(first) == "fp8" else f"in {precision(first)}"
        raise UserError(
            f"`{first['name']}` trained {how}, `{other['name']}` in {precision(other)}: their gap would mix the "
            "precision into the architecture's; compare runs of one precision, or pass --mixed-precision"
        )


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
    return os.path.join(base_dir or get_base_dir(), "reports", folder_name([(r["name"], run_step(r)) for r in runs]))


def check_report_folder(out_dir, inputs):
    """The default folder is named after the runs and steps only: refuse to replace a report of other runs or
    evaluations there (the same runs with other report settings move to replaced/ instead: run_dir.publish)."""
    old = read_inputs(out_dir)
    if old is None or old.get("runs") == inputs["runs"]:
        return  # nothing of compare's there (run_dir.claim_folder guards the rest), or the same runs
    if len(old.get("runs") or []) != len(inputs["runs"]):
        what = "other runs"
    else:
        changes = []
        for o, n in zip(old["runs"], inputs["runs"]):
            if o.get("dir") != n["dir"]:
                changes.append(f"{o.get('dir')} where this is {n['dir']}")
            elif o != n:
                changes.append(f"an earlier evaluation of {n['dir']}")
        what = "; ".join(changes)
    raise UserError(
        f"{out_dir} holds a report of other inputs ({what}); pass --out DIR to write this one elsewhere, "
        f"or --out {out_dir} to replace it (the earlier report then moves to {os.path.join(out_dir, 'replaced')}/)"
    )
