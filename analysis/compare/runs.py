"""
What a comparison reads off the loaded runs (nanochat.run_dir.load_run).

The curves and scores of each, what
its numbers were measured with, and whether two runs were measured alike.
"""

import json

from nanochat.common import UserError
from nanochat.step_timer import PHASES

N_RESAMPLES = 10000  # bootstrap resamples of every interval of a report
SKIP_ARGS = {"run"}  # differs by construction; the report's columns already name the runs


# ---------------------------------------------------------------------------
# curves and scores of one run


def ema(values, beta):
    """Bias-corrected exponential moving average, the smoothing nanochat logs train loss with."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc = beta * acc + (1 - beta) * v
        out.append(acc / (1 - beta ** (i + 1)))
    return out


def loss_curve(run):
    rows = [r for r in run["metrics"] if r.get("train_loss") is not None and r.get("flops") is not None]
    return [r["flops"] for r in rows], [r["train_loss"] for r in rows]


def last_logged(run, key):
    """(step, value) of the last metrics row holding key, or (None, None)."""
    vals = [(row["step"], row[key]) for row in run["metrics"] if row.get(key) is not None]
    return vals[-1] if vals else (None, None)


def flat_config(config):
    """CLI args (as --flags), model_config.*, nag_config.*, mod_config.* and optimizer.* (per group, by name) of one
    run."""
    out = {f"--{k.replace('_', '-')}": v for k, v in (config.get("args") or {}).items() if k not in SKIP_ARGS}
    for section in ("model_config", "nag_config", "mod_config"):
        out.update({f"{section}.{k}": v for k, v in (config.get(section) or {}).items()})
    opt = dict(config.get("optimizer") or {})
    for group in opt.pop("groups", []):
        out.update({f"optimizer.{group['name']}.{k}": v for k, v in group.items() if k not in ("name", "num_params")})
    for k, v in opt.items():
        out.update(
            {f"optimizer.{k}.{kk}": vv for kk, vv in v.items()} if isinstance(v, dict) else {f"optimizer.{k}": v}
        )
    return out


def core_value(rec):
    """(score, tasks scored, full) of one evaluation record's CORE, or None without CORE results."""
    if not rec.get("tasks"):
        return None
    n = rec.get("num_tasks_scored", len(rec["tasks"]))
    if rec.get("core_metric") is not None:
        return rec["core_metric"], n, True
    return (rec["partial_core"], n, False) if rec.get("partial_core") is not None else None


def several_steps(runs):
    return any(len(r["history"]) > 1 for r in runs)


def time_shares(run):
    """{part: its mean share of a logged step's time} over the rows with a breakdown (metrics.jsonl `time`,
    docs/runs.md), or None for a run trained before base_train measured one. Each row counts once, whatever interval it
    covers."""
    rows = [r["time"] for r in run["metrics"] if isinstance(r.get("time"), dict) and sum(r["time"].values()) > 0]
    if not rows:
        return None
    return {p: sum(t.get(p, 0.0) / sum(t.values()) for t in rows) / len(rows) for p in PHASES}


def mod_curves(runs):
    return [(r, r["eval"]["mod_curve"]) for r in runs if r["eval"] and r["eval"].get("mod_curve")]


# ---------------------------------------------------------------------------
# what the numbers were measured with


# label -> (where it is read, key): what a run's numbers depend on besides its weights. A fingerprint
# is read from "fingerprints" of that record; the evaluation's tokenizer is the training one where the
# evaluation did not record it (base_eval refuses a tokenizer other than the checkpoint's).
MEASURED_WITH = {
    "training data": ("config", "data_train"),
    "training processes": ("config", "world_size"),
    "tokenizer": ("eval", "tokenizer"),
    "val data": ("eval", "data_val"),
    "val tokens": ("eval", "split_tokens"),
    "evaluation processes": ("eval", "world_size"),
}
KEY_NAMES = {
    "data_train": "data_train fingerprint",
    "data_val": "data_val fingerprint",
    "tokenizer": "tokenizer fingerprint",
    "split_tokens": "split_tokens",
    "world_size": "world_size",
}
FINGERPRINTS = ("tokenizer", "data_train", "data_val")
# differences that make two val bpb numbers measure different things: no interval between them
BPB_DEPENDS_ON = ("training data", "tokenizer", "val data", "val tokens", "evaluation processes")


def measured_with(run):
    """label -> value (None: not recorded) of what the run's numbers depend on; eval-side labels only
    where base_eval measured val bpb."""
    records = {"config": run["config"], "eval": run["eval"] or {}}
    out = {}
    for label, (source, key) in MEASURED_WITH.items():
        if source == "eval" and records["eval"].get("val_bpb") is None:
            continue
        rec = records[source]
        value = (rec.get("fingerprints") or {}).get(key) if key in FINGERPRINTS else rec.get(key)
        if value is None and key == "tokenizer":
            value = (run["config"].get("fingerprints") or {}).get(key)
        if label == "evaluation processes" and "num_val_batches" in rec:
            # base_eval's val batches are the same under any process count since it records num_val_batches
            value = "any"
        out[label] = value
    return out


def pair_differences(a, b):
    """(differ, unknown) of run b against run a: {label: 'key x vs y'} for what both recorded and differs,
    {label: [names of the runs that did not record it]} for what cannot be checked."""
    ma, mb = measured_with(a), measured_with(b)
    differ, unknown = {}, {}
    for label in ma:
        if label not in mb:
            continue
        x, y = ma[label], mb[label]
        if x is None or y is None:
            unknown[label] = [r["name"] for r, v in ((a, x), (b, y)) if v is None]
        elif x != y:
            differ[label] = f"{KEY_NAMES[MEASURED_WITH[label][1]]} {x} vs {y}"
    return differ, unknown


def versions_note(runs):
    """One line when the runs trained with other package versions (config.json's `versions`), else None: a note, not
    a refusal, since the same seed on other versions moves float results in their last digits only (docs/runs.md)."""
    recorded = [(r["name"], r["config"].get("versions")) for r in runs if r["config"].get("versions")]
    differ = []
    for package in sorted({p for _, v in recorded for p in v}):
        seen = {}
        for name, versions in recorded:
            seen.setdefault(str(versions.get(package)), []).append(f"`{name}`")
        if len(seen) > 1:
            differ.append(f"{package} " + " vs ".join(f"{v} ({', '.join(names)})" for v, names in seen.items()))
    return f"the runs trained with other package versions: {'; '.join(differ)}" if differ else None


def incomplete_core(run):
    """One line naming the run's CORE evaluation as incomplete when it stopped before its last task (Ctrl-C, a kill,
    a crash: eval.json says "interrupted"), with how to finish it; else None."""
    ev = run["eval"] or {}
    if not ev.get("interrupted"):
        return None
    k = len(ev.get("tasks") or {})
    n = k + len(ev.get("interrupted_tasks") or [])
    limit = f" --max-per-task {ev['max_per_task']}" if (ev.get("max_per_task") or -1) > 0 else ""
    bundle = f" --eval-bundle {ev['eval_bundle']}" if ev.get("eval_bundle") else ""
    return (
        f"incomplete CORE in run `{run['name']}` ({k} of {n} tasks: its evaluation stopped before the last one); "
        f"finish it with `python -m scripts.base_eval --run {run['dir']} --eval core{limit}{bundle}` (it resumes "
        "at the first task not scored), then compare again"
    )


def check_same_items(a, b):
    """Refuse two runs whose CORE records are not on the same items with the same settings; where their tasks
    differ because a CORE evaluation was cut short, say that rather than blame the settings."""
    (cols_a, sa), (cols_b, sb) = a["records"], b["records"]
    cut = [incomplete_core(r) for r in (a, b) if incomplete_core(r)]
    if cut and list(sa["tasks"]) != list(sb["tasks"]):
        raise UserError(cut[0])
    diff = None
    if sa.get("max_per_task") != sb.get("max_per_task"):
        diff = f"--max-per-task {sa.get('max_per_task')} vs {sb.get('max_per_task')}"
    elif list(sa["tasks"]) != list(sb["tasks"]):
        only = sorted(set(sa["tasks"]) ^ set(sb["tasks"]))
        diff = f"tasks scored differ: {', '.join(only) or 'order'}"
    else:
        for label in sa["tasks"]:
            if sa["tasks"][label] != sb["tasks"][label]:
                diff = (
                    f"task {label} settings {json.dumps(sa['tasks'][label], sort_keys=True)} "
                    f"vs {json.dumps(sb['tasks'][label], sort_keys=True)}"
                )
                break
        else:
            items_a = dict(zip(zip(cols_a["task"], cols_a["idx"]), cols_a["item"]))
            items_b = dict(zip(zip(cols_b["task"], cols_b["idx"]), cols_b["item"]))
            if items_a != items_b:
                label = next(
                    t for t, i in sorted(set(items_a) | set(items_b)) if items_a.get((t, i)) != items_b.get((t, i))
                )
                diff = f"the items of task {label} differ (another eval bundle?)"
    if diff:
        raise UserError(
            f"`{a['name']}` and `{b['name']}` were evaluated on different CORE items or settings ({diff}); "
            "evaluate both with the same bundle and --max-per-task"
        )
