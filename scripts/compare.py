"""
Compare training runs, typically a FLOP-matched GPT / NAG pair: one markdown report plus figures.

    python -m scripts.compare gpt-tiny nag-tiny
    python -m scripts.compare gpt-tiny nag-tiny --out /tmp/nag-chat-report
    python -m scripts.compare --a gpt-s1 gpt-s2 gpt-s3 --b nag-s1 nag-s2 nag-s3   # groups of seeds: scripts/compare_groups.py

Each RUN is a run name under $NANOCHAT_BASE_DIR/runs or a path to a run directory. Reads
config.json, metrics.jsonl and (if base_eval has run) eval.json, eval/step_*.json and
core_records.parquet of each; writes report.md, PNG figures and inputs.json (what the report was made
from) into --out. The default, $NANOCHAT_BASE_DIR/reports/<run1>@<step>_vs_<run2>@<step>, is named
after the runs and their evaluated steps only, so a report there of other inputs (other run
directories of the same names, a re-evaluation) is never replaced: compare stops and asks for --out.

Every delta against the first run comes with a paired 95% bootstrap interval (nanochat/stats.py):
CORE resampled over items within each task, val bpb over the shared evaluation batches, each only
with enough of them (stats.MIN_UNITS). Runs evaluated on different CORE items or settings are
refused; runs whose val bpb was measured with another tokenizer, val data, number of val tokens or
of processes, or that were trained on other data, get both numbers, the reason, and no interval.
"""

import io
import os
import re
import json
import hashlib
import argparse

from nanochat.common import UserError, exit_on_user_error, get_base_dir, atomic_write_bytes, atomic_write_json, ensure_writable_dir
from nanochat.checkpoint_manager import resolve_run_dir, get_run_dir
from nanochat.core_eval import NUM_CORE_TASKS, load_records
from nanochat.step_timer import PHASES, LABELS
from nanochat import stats

N_RESAMPLES = 10000

SKIP_ARGS = {"run"}  # differs by construction; the report's columns already name the runs
STEP_FILE = re.compile(r"step_(\d+)\.json")  # base_eval's history: eval/step_000123.json, one per evaluated step
INPUTS = "inputs.json"  # in the report folder: the inputs it was made from


# ---------------------------------------------------------------------------
# reading runs


def existing_run_dir(run):
    path = resolve_run_dir(run)
    if not os.path.isdir(path):
        raise UserError(f"no run directory {path}; give a run name under {os.path.join(get_base_dir(), 'runs')} or a path")
    return os.path.normpath(path)


def read_json(path):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not valid JSON ({e})") from None


def read_metrics(path):
    """(rows, notes) of metrics.jsonl. A line that is not a JSON object with a step is an error naming
    the line, except a torn last line (what a kill mid-write leaves), skipped with a note. Steps must
    increase: a repeated or earlier step means two processes wrote the run, or a resume went wrong."""
    if not os.path.exists(path):
        raise UserError(f"{path} is missing; is {os.path.dirname(path)} a run directory written by scripts.base_train?")
    with open(path, "rb") as f:
        lines = [(lineno, raw) for lineno, raw in enumerate(f, 1) if raw.strip()]
    rows, notes = [], []
    for k, (lineno, raw) in enumerate(lines):
        try:
            row = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            if k == len(lines) - 1 and rows:
                notes.append(f"{path} line {lineno} is torn (a write cut short) and was skipped")
                break
            raise UserError(f"{path} line {lineno}: malformed JSON") from None
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            raise UserError(f"{path} line {lineno}: expected a JSON object with an integer step")
        if rows and row["step"] <= rows[-1]["step"]:
            kind = "repeats" if any(r["step"] == row["step"] for r in rows) else "goes back to"
            raise UserError(f"{path} line {lineno} {kind} step {row['step']} (after step {rows[-1]['step']}): "
                            "the log mixes two writers or an undone resume; restore it before comparing")
        rows.append(row)
    if not rows:
        raise UserError(f"{path} has no rows; the run logged no step")
    return rows, notes


def load_core_records(run_dir, ev):
    """(columns, settings) of the run's CORE records, or None when eval.json has no CORE results.
    Records missing (an eval.json from before they were kept), damaged, or not of this eval.json are errors."""
    if not ev or not ev.get("tasks"):
        return None
    path = os.path.join(run_dir, "core_records.parquet")
    if not ev.get("core_records") or not os.path.exists(path):
        raise UserError(f"{run_dir} has CORE scores but no per-example records ({os.path.basename(path)}), so no interval can be "
                        f"computed; rerun `python -m scripts.base_eval --run {run_dir} --eval core`")
    cols, settings = load_records(path)
    if settings.get("step") != ev.get("step") or set(settings.get("tasks", {})) != set(ev["tasks"]):
        raise UserError(f"{path} does not belong to eval.json next to it (other step or tasks); rerun scripts.base_eval")
    return cols, settings


def history_files(run_dir):
    folder = os.path.join(run_dir, "eval")
    names = sorted(f for f in os.listdir(folder) if STEP_FILE.fullmatch(f)) if os.path.isdir(folder) else []
    return [os.path.join(folder, f) for f in names]


def eval_history(run_dir, ev):
    """[(step, record)] of every evaluated step, by step: eval/step_*.json, plus eval.json where the
    history lacks its step (an evaluation from before base_eval kept one)."""
    by_step = {}
    for path in history_files(run_dir):
        rec = read_json(path)
        if not isinstance(rec, dict):
            raise UserError(f"{path} is not an evaluation record (a JSON object); rerun scripts.base_eval at that step")
        step = rec.get("step") if isinstance(rec.get("step"), int) else int(STEP_FILE.fullmatch(os.path.basename(path))[1])
        by_step[step] = rec
    if ev and isinstance(ev.get("step"), int):
        by_step.setdefault(ev["step"], ev)
    return sorted(by_step.items())


def load_run(arg):
    run_dir = existing_run_dir(arg)
    cfg_path = os.path.join(run_dir, "config.json")
    if not os.path.exists(cfg_path):
        raise UserError(f"{cfg_path} is missing; is {run_dir} a run directory written by scripts.base_train?")
    config = read_json(cfg_path)
    eval_path = os.path.join(run_dir, "eval.json")
    metrics, notes = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    ev = read_json(eval_path) if os.path.exists(eval_path) else None
    if ev is not None and not isinstance(ev, dict):
        raise UserError(f"{eval_path} is not an evaluation record (a JSON object); rerun scripts.base_eval")
    return {
        "dir": run_dir,
        "name": config.get("run") or os.path.basename(run_dir),
        "config": config,
        "metrics": metrics,
        "eval": ev,
        "history": eval_history(run_dir, ev),
        "records": load_core_records(run_dir, ev),
        "notes": notes,
    }


# ---------------------------------------------------------------------------
# the report folder and what it was made from


def eval_files(run_dir):
    """The files a report's evaluation numbers come from."""
    named = [os.path.join(run_dir, f) for f in ("eval.json", "core_records.parquet")]
    return [p for p in named if os.path.isfile(p)] + history_files(run_dir)


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
            if os.path.basename(path) == "eval.json":
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


# ---------------------------------------------------------------------------
# numbers


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


def fmt_count(n):
    if n is None:
        return "—"
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:g}"


def fmt(x, spec=".4f"):
    return "—" if x is None else format(x, spec)


def cell(v):
    """A config value as a markdown table cell."""
    if v is None:
        return "—"
    text = v if isinstance(v, str) else json.dumps(v)
    return (text or '""').replace("|", "\\|").replace("\n", " ")


def flat_config(config):
    """CLI args (as --flags), model_config.*, nag_config.*, mod_config.* and optimizer.* (per group, by name) of one run."""
    out = {f"--{k.replace('_', '-')}": v for k, v in (config.get("args") or {}).items() if k not in SKIP_ARGS}
    for section in ("model_config", "nag_config", "mod_config"):
        out.update({f"{section}.{k}": v for k, v in (config.get(section) or {}).items()})
    opt = dict(config.get("optimizer") or {})
    for group in opt.pop("groups", []):
        out.update({f"optimizer.{group['name']}.{k}": v for k, v in group.items() if k not in ("name", "num_params")})
    for k, v in opt.items():
        out.update({f"optimizer.{k}.{kk}": vv for kk, vv in v.items()} if isinstance(v, dict) else {f"optimizer.{k}": v})
    return out


def core_cells(ev):
    """(CORE cell, partial CORE cell) of one eval.json. A partial score is never shown as CORE."""
    if ev is None or not ev.get("tasks"):
        return "—", "—"
    n = ev.get("num_tasks_scored", len(ev["tasks"]))
    if ev.get("core_metric") is not None:
        return f"{ev['core_metric']:.4f}", f"{ev['core_metric']:.4f} ({n}/{NUM_CORE_TASKS})"
    cut = ", interrupted" if ev.get("interrupted") else ""
    return "— (partial only)", f"{ev['partial_core']:.4f} ({n}/{NUM_CORE_TASKS}{cut})"


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
KEY_NAMES = {"data_train": "data_train fingerprint", "data_val": "data_val fingerprint", "tokenizer": "tokenizer fingerprint",
             "split_tokens": "split_tokens", "world_size": "world_size"}
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
            value = "any"  # base_eval's val batches are the same under any process count since it records num_val_batches
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


def difference_lines(ps):
    """The pair's differences in what its numbers were measured with, and what could not be checked, in words."""
    a, b = ps["a"]["name"], ps["b"]["name"]
    lines = []
    if ps["differ"]:
        what = "; ".join(f"{label} ({text})" for label, text in ps["differ"].items())
        lines.append(f"`{b}` vs `{a}` differ in {what}")
        if "training data" in ps["differ"]:
            lines.append(f"`{b}` and `{a}` were trained on different data: their differences mix the architecture with the corpus")
        if "training processes" in ps["differ"]:
            lines.append(f"`{b}` and `{a}` were trained with different numbers of processes: NAG gate telemetry and the "
                         "training log's val bpb are measured per process count and do not compare exactly")
    if ps["unknown"]:
        runs = sorted({n for names in ps["unknown"].values() for n in names})
        lines.append(f"not recorded for {', '.join(f'`{n}`' for n in runs)} (written before compare could check them): "
                     f"{', '.join(ps['unknown'])}; compare cannot tell whether `{b}` and `{a}` share them")
    return lines


def measured_section(runs, pairs):
    labels = [label for label in MEASURED_WITH if any(label in measured_with(r) for r in runs)]
    cols = [measured_with(r) for r in runs]

    def value(col, label):
        if label not in col:
            return "—"
        return "not recorded" if col[label] is None else f"`{col[label]}`"

    rows = [[label, *[value(c, label) for c in cols]] for label in labels]
    out = "## What the numbers were measured with\n\n" + table(["", *[f"`{r['name']}`" for r in runs]], rows)
    lines = [line for ps in pairs for line in difference_lines(ps)]
    if lines:
        out += "\n\n" + "\n".join(f"- {line}" for line in lines)
    return out + "\n"


# ---------------------------------------------------------------------------
# report sections


def table(header, rows, align=None):
    align = align or ["---"] + ["---:"] * (len(header) - 1)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def last_logged(run, key):
    """(step, value) of the last metrics row holding key, or (None, None)."""
    vals = [(row["step"], row[key]) for row in run["metrics"] if row.get(key) is not None]
    return vals[-1] if vals else (None, None)


def summary_column(run, beta, first_flops):
    """label -> cell of one run in the summary table."""
    cfg, end, ev = run["config"], run["metrics"][-1], run["eval"] or {}
    steps = f"{end['step']:,}"
    if isinstance(cfg.get("num_iterations"), int) and cfg["num_iterations"] != end["step"]:
        steps += f" of {cfg['num_iterations']:,} planned"
    losses = loss_curve(run)[1]
    val_step, val_bpb = last_logged(run, "val_bpb")
    core, partial = core_cells(run["eval"])
    col = {
        "arch": cfg.get("arch", "—"),
        "steps": steps,
        "tokens": fmt_count(end.get("tokens")),
        "training FLOPs": fmt(end.get("flops"), ".3e"),
    }
    if first_flops:  # how well the pair is FLOP-matched
        col["FLOPs vs first run"] = f"{100 * (end.get('flops', 0) / first_flops - 1):+.2f}%"
    col.update({
        "FLOPs / token": fmt_count(cfg.get("flops_per_token")),
        "params": fmt_count(cfg.get("num_params")),
        "matmul params": fmt_count(cfg.get("num_scaling_params")),
        "batch (tokens)": fmt_count(cfg.get("total_batch_size")),
        f"final train loss (EMA β={beta:g})": fmt(ema(losses, beta)[-1] if losses else None),
        "final val bpb (training log)": f"{val_bpb:.4f} (step {val_step:,})" if val_step is not None else "—",
        "training time": f"{end['elapsed']:,.0f} s" if end.get("elapsed") is not None else "—",
        "eval step (base_eval)": f"{ev['step']:,}" if isinstance(ev.get("step"), int) else "no eval.json",
        "val bpb (base_eval)": fmt(ev.get("val_bpb")),
        "train bpb (base_eval)": fmt(ev.get("train_bpb")),
        "CORE": core,
        "partial CORE (tasks scored)": partial,
    })
    return col


def summary_section(runs, beta):
    first_flops = runs[0]["metrics"][-1].get("flops") if len(runs) > 1 else None
    cols = [summary_column(r, beta, first_flops) for r in runs]
    rows = [[label, *[c.get(label, "—") for c in cols]] for label in cols[0]]
    return "## Summary\n\n" + table(["", *[f"`{r['name']}`" for r in runs]], rows)


def config_section(runs):
    flats = [flat_config(r["config"]) for r in runs]
    keys = []
    for f in flats:
        keys += [k for k in f if k not in keys]
    diff = [k for k in keys if len({json.dumps(f.get(k), sort_keys=True) for f in flats}) > 1]
    out = "## Configuration differences\n\n"
    if len(runs) < 2:
        return out + "One run: nothing to compare.\n"
    if not diff:
        return out + "The runs have identical CLI arguments and model configs.\n"
    return out + table(["setting", *[f"`{r['name']}`" for r in runs]], [[f"`{k}`", *[cell(f.get(k)) for f in flats]] for k in diff])


def core_section(runs):
    evals = [r["eval"] if r["eval"] and r["eval"].get("tasks") else None for r in runs]
    out = "## CORE tasks (centred accuracy)\n\n"
    if not any(evals):
        return out + "No run has CORE results (run `python -m scripts.base_eval`).\n"
    labels = []
    for ev in evals:
        labels += [t for t in ((ev or {}).get("tasks") or {}) if t not in labels]
        labels += [t for t in ((ev or {}).get("missing_tasks") or []) if t not in labels]
    base = evals[0]

    def value(ev, label):
        if ev is None:
            return None, "—"
        if label in ev["tasks"]:
            return ev["tasks"][label]["centered"], f"{ev['tasks'][label]['centered']:+.4f}"
        return None, "missing" if label in (ev.get("missing_tasks") or []) else "—"

    header = ["task", *[f"`{r['name']}`" for r in runs], *[f"Δ `{r['name']}`" for r in runs[1:]]]
    rows = []
    for label in labels:
        vals = [value(ev, label) for ev in evals]
        b = vals[0][0]
        deltas = [f"{v - b:+.4f}" if v is not None and b is not None else "—" for v, _ in vals[1:]]
        rows.append([label, *[text for _, text in vals], *deltas])
    # the partial scores of runs missing different tasks do not compare; the mean over shared tasks does
    common = [t for t in labels if all(ev is not None and t in ev["tasks"] for ev in evals)]
    if common and len(runs) > 1:
        means = [sum(ev["tasks"][t]["centered"] for t in common) / len(common) for ev in evals]
        rows.append([f"**mean over the {len(common)} tasks all runs scored**", *[f"{m:+.4f}" for m in means],
                     *[f"{m - means[0]:+.4f}" for m in means[1:]]])
    out += table(header, rows)
    if base is None and len(runs) > 1:
        out += f"\n\nDeltas are against `{runs[0]['name']}`, which has no CORE results, so none are shown."
    return out + "\n"


# ---------------------------------------------------------------------------
# intervals: is a delta larger than the noise of the items it was measured on?


def check_same_items(a, b):
    """Refuse two runs whose CORE records are not on the same items with the same settings."""
    (cols_a, sa), (cols_b, sb) = a["records"], b["records"]
    diff = None
    if sa.get("max_per_task") != sb.get("max_per_task"):
        diff = f"--max-per-task {sa.get('max_per_task')} vs {sb.get('max_per_task')}"
    elif list(sa["tasks"]) != list(sb["tasks"]):
        only = sorted(set(sa["tasks"]) ^ set(sb["tasks"]))
        diff = f"tasks scored differ: {', '.join(only) or 'order'}"
    else:
        for label in sa["tasks"]:
            if sa["tasks"][label] != sb["tasks"][label]:
                diff = f"task {label} settings {json.dumps(sa['tasks'][label], sort_keys=True)} vs {json.dumps(sb['tasks'][label], sort_keys=True)}"
                break
        else:
            items_a = dict(zip(zip(cols_a["task"], cols_a["idx"]), cols_a["item"]))
            items_b = dict(zip(zip(cols_b["task"], cols_b["idx"]), cols_b["item"]))
            if items_a != items_b:
                label = next(t for t, i in sorted(set(items_a) | set(items_b)) if items_a.get((t, i)) != items_b.get((t, i)))
                diff = f"the items of task {label} differ (another eval bundle?)"
    if diff:
        raise UserError(f"`{a['name']}` and `{b['name']}` were evaluated on different CORE items or settings ({diff}); "
                        "evaluate both with the same bundle and --max-per-task")


def items_text(task_stats):
    sizes = {t["n"] for t in task_stats.values()}
    return f"{sizes.pop()} items per task" if len(sizes) == 1 else f"{sum(t['n'] for t in task_stats.values()):,} items over {len(task_stats)} tasks"


def sentence(a, b, what, r, where):
    """The verdict in words: the delta, its interval, and whether it stands out of the noise; without
    enough units (stats.MIN_UNITS) the delta alone and why there is no interval."""
    if r.get("too_few"):  # the delta, but no interval, p-value or verdict
        return f"{b} − {a} {what} = {r['delta']:+.4f}: {r['too_few']}"
    lo, hi = r["ci"]
    call = "distinguishable from noise" if lo > 0 or hi < 0 else "not distinguishable from noise"
    return f"{b} − {a} {what} = {r['delta']:+.4f} (95% CI {lo:+.4f} … {hi:+.4f}, p = {r['p']:.3g}): {call} {where}"


def core_stats(a, b):
    """CORE interval of b against a, per task and aggregate, each marked too_few where it has too few items."""
    check_same_items(a, b)
    (cols_a, settings), (cols_b, _) = a["records"], b["records"]
    r = stats.core_delta_interval(cols_a, cols_b, settings, n_resamples=N_RESAMPLES, seed=0)
    T = len(settings["tasks"])
    full = T == NUM_CORE_TASKS and a["eval"].get("core_metric") is not None and b["eval"].get("core_metric") is not None
    r["label"] = "CORE" if full else f"partial CORE ({T}/{NUM_CORE_TASKS})"
    # each task's interval resamples its items; the aggregate sums them, so it rests on all the items
    for t in r["tasks"].values():
        t["too_few"] = stats.too_few_units(t["n"], "items")
    r["too_few"] = stats.too_few_units(sum(t["n"] for t in r["tasks"].values()), "items")
    # the smallest difference this evaluation resolves, from how often the two runs disagree per task
    disc, sizes, bases = {}, {}, {}
    for label, info in settings["tasks"].items():
        ca = {i: c for t, i, c in zip(cols_a["task"], cols_a["idx"], cols_a["correct"]) if t == label}
        cb = {i: c for t, i, c in zip(cols_b["task"], cols_b["idx"], cols_b["correct"]) if t == label}
        disc[label] = sum(ca[i] != cb[i] for i in ca) / len(ca)
        sizes[label], bases[label] = len(ca), info["random_baseline"]
    r["mde"], r["se"] = stats.min_detectable_core_diff(sizes, bases, discordance=disc)
    return r


def pair_stats(a, b):
    """Intervals of run b against run a: CORE (with per-task deltas) and val bpb, each where both runs
    have what it needs; `sentences` says what was found, `notes` why something is missing."""
    out = {"a": a, "b": b, "core": None, "bpb": None, "sentences": [], "notes": []}
    out["differ"], out["unknown"] = pair_differences(a, b)
    if a["records"] and b["records"]:
        r = out["core"] = core_stats(a, b)
        out["sentences"].append(sentence(a["name"], b["name"], r["label"], r, f"at {items_text(r['tasks'])}"))
    elif (a["eval"] or {}).get("tasks") or (b["eval"] or {}).get("tasks"):
        out["notes"].append("only one of the runs has CORE results: no CORE interval")
    ea, eb = a["eval"] or {}, b["eval"] or {}
    if ea.get("val_bpb") is None or eb.get("val_bpb") is None:
        return out
    va, vb = ea.get("val_batches"), eb.get("val_batches")
    both = f"{b['name']} − {a['name']} val bpb = {eb['val_bpb'] - ea['val_bpb']:+.4f} ({a['name']} {ea['val_bpb']:.4f}, {b['name']} {eb['val_bpb']:.4f})"
    refuse = [f"{label} ({out['differ'][label]})" for label in BPB_DEPENDS_ON if label in out["differ"]]
    if refuse:  # both numbers, and the true reason they do not pair
        out["sentences"].append(f"{both}: no interval, the runs differ in {'; '.join(refuse)}")
    elif not (isinstance(va, dict) and isinstance(vb, dict) and va.get("nats") and vb.get("nats")):
        out["notes"].append("an eval.json without per-batch val losses (from before they were kept): no bpb interval; rerun base_eval")
    elif va.get("bytes") != vb.get("bytes"):
        unknown = [label for label in BPB_DEPENDS_ON if label in out["unknown"]]
        why = (f"{', '.join(unknown)} not recorded" if unknown else
               "with the same tokenizer, val data, val tokens and processes: another --device-batch-size or sequence length")
        out["sentences"].append(f"{both}: no interval, the runs' val batches differ ({len(va['nats'])} vs {len(vb['nats'])} batches, "
                                f"other byte counts; {why})")
    else:
        r = stats.bpb_delta_interval(va["nats"], vb["nats"], va["bytes"], n_resamples=N_RESAMPLES, seed=0)
        r["too_few"] = stats.too_few_units(r["batches"], "batches")
        out["bpb"] = r
        out["sentences"].append(sentence(a["name"], b["name"], "val bpb", r, f"on {r['batches']} shared val batches (lower is better)"))
    return out


def interval_cells(r):
    """Δ (starred where the interval excludes 0), interval and p cells of one row; too few items: the reason."""
    if r.get("too_few"):
        return [f"{r['delta']:+.4f}", r["too_few"], "—"]
    mark = " \\*" if r["ci"][0] > 0 or r["ci"][1] < 0 else ""
    return [f"{r['delta']:+.4f}{mark}", f"{r['ci'][0]:+.4f} … {r['ci'][1]:+.4f}", f"{r['p']:.3g}"]


def significance_section(pairs):
    out = ["## Is the difference real? (paired 95% bootstrap intervals)"]
    for ps in pairs:
        a, b = ps["a"]["name"], ps["b"]["name"]
        out.append(f"### `{b}` vs `{a}`")
        out.append("\n".join(f"- {s}" for s in ps["sentences"] + [f"no interval: {n}" for n in ps["notes"]]) or "Nothing to compare.")
        r = ps["core"]
        if r is None:
            continue
        rows = [[f"`{label}`", *interval_cells(t), f"{t['se_a']:.4f}", f"{t['se_b']:.4f}", t["n"]] for label, t in r["tasks"].items()]
        rows.append([f"**{r['label']}**", *interval_cells(r), "", "", ""])
        out.append(table(["task", f"Δ centred (`{b}` − `{a}`)", "95% CI", "p", f"SE `{a}`", f"SE `{b}`", "items"], rows))
        out.append(f"\\* the 95% interval excludes 0. Items are resampled within each task ({N_RESAMPLES:,} resamples, seed 0), "
                   f"where a task has at least {stats.MIN_UNITS} (the aggregate: all items together); "
                   f"SE is one run's standard error of the centred accuracy. With these items and how often the two runs "
                   f"disagree, the smallest {r['label']} difference found 80% of the time at the 5% level is "
                   f"±{r['mde']:.4f} (SE {r['se']:.4f}).")
    return "\n\n".join(out) + "\n"


def history_notes(runs):
    """A run whose evaluated steps were measured differently: its curve over steps mixes them."""
    lines = []
    for r in runs:
        for key in ("split_tokens", "world_size", "tokenizer", "data_val"):
            seen = {}
            for step, rec in r["history"]:
                if rec.get("val_bpb") is None:
                    continue
                value = (rec.get("fingerprints") or {}).get(key) if key in FINGERPRINTS else rec.get(key)
                seen.setdefault("not recorded" if value is None else str(value), step)
            if len(seen) > 1:
                where = ", ".join(f"{v} at step {step}" for v, step in seen.items())
                lines.append(f"`{r['name']}`: its evaluated steps differ in {KEY_NAMES[key]} ({where}); its val bpb over steps mixes them.")
    return lines


def notes(runs, figures):
    lines = [n for r in runs for n in r["notes"]]
    for r in runs:
        name, ev = r["name"], r["eval"]
        if ev is None:
            where = name if os.path.normpath(get_run_dir(name)) == r["dir"] else r["dir"]
            lines.append(f"`{name}` has no eval.json: its CORE and base_eval bpb are not shown "
                         f"(run `python -m scripts.base_eval --run {where}`).")
            continue
        if ev.get("tasks") and ev.get("core_metric") is None:
            missing = ", ".join(ev.get("missing_tasks") or []) or "none"
            why = ""
            if ev.get("interrupted"):  # base_eval resumes it at the first task not reached
                left = ", ".join(ev.get("interrupted_tasks") or []) or "not recorded"
                why = f"the CORE evaluation was interrupted (tasks not reached: {left}; rerun base_eval to resume it): "
            lines.append(f"`{name}`: {why}CORE was scored on {ev.get('num_tasks_scored')} of {NUM_CORE_TASKS} tasks, so only a "
                         f"partial CORE is shown (missing: {missing}).")
        if not ev.get("tasks") and ev.get("core_error"):
            lines.append(f"`{name}`: CORE was not evaluated ({ev['core_error']}).")
        if ev.get("step") != r["metrics"][-1]["step"]:
            lines.append(f"`{name}`: eval.json is of step {ev.get('step')}, the training log ends at step {r['metrics'][-1]['step']}.")
        if (ev.get("max_per_task") or -1) > 0 and ev.get("tasks"):
            lines.append(f"`{name}`: CORE used at most {ev['max_per_task']} examples per task, a subset of the full protocol.")
    lines += history_notes(runs)
    limits = {json.dumps(r["eval"].get("max_per_task")) for r in runs if r["eval"] and r["eval"].get("tasks")}
    if len(limits) > 1:
        lines.append("The runs' CORE scores used different --max-per-task limits and do not compare exactly.")
    if not any(name.startswith("gate_") for name in figures) and any(r["config"].get("arch") == "nag" for r in runs):
        lines.append("No gate telemetry in the NAG runs' metrics.jsonl (trained with --nag-gate-log-every 0?).")
    return "## Notes\n\n" + "\n".join(f"- {line}" for line in lines) + "\n" if lines else ""


# ---------------------------------------------------------------------------
# figures


def save_figure(fig, ax, out_dir, name, caption, figures):
    """Grid, write the PNG atomically, record its caption in figures, close."""
    ax.grid(alpha=0.3)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120, bbox_inches="tight")
    atomic_write_bytes(os.path.join(out_dir, name), buf.getvalue())
    figures[name] = caption
    import matplotlib.pyplot as plt  # imported by make_figures after choosing the Agg backend
    plt.close(fig)


def forest_plot(pairs, out_dir, figures):
    """Per-task and CORE deltas against the first run with their 95% intervals, one row per task."""
    import matplotlib.pyplot as plt
    pairs = [ps for ps in pairs if ps["core"] is not None]
    if not pairs:
        return
    labels = list(pairs[0]["core"]["tasks"]) + [pairs[0]["core"]["label"]]
    fig, ax = plt.subplots(figsize=(8, 1.5 + 0.35 * len(labels)))
    for k, ps in enumerate(pairs):
        r, color = ps["core"], f"C{(k + 1) % 10}"
        rows = [r["tasks"][t] for t in labels[:-1]] + [r]
        y = [len(labels) - 1 - i + 0.15 * (k - (len(pairs) - 1) / 2) for i in range(len(labels))]
        shown = [(x, yy) for x, yy in zip(rows, y) if not x.get("too_few")]
        bare = [(x, yy) for x, yy in zip(rows, y) if x.get("too_few")]  # too few items: the delta, hollow, no bar
        if shown:
            err = [[x["delta"] - x["ci"][0] for x, _ in shown], [x["ci"][1] - x["delta"] for x, _ in shown]]
            ax.errorbar([x["delta"] for x, _ in shown], [yy for _, yy in shown], xerr=err, fmt="o", color=color, capsize=3)
        if bare:
            ax.plot([x["delta"] for x, _ in bare], [yy for _, yy in bare], "o", color=color, markerfacecolor="none")
        ax.plot(rows[-1]["delta"], y[-1], "D", color=color, markersize=9, markerfacecolor="none" if r.get("too_few") else color,
                label=f"{ps['b']['name']} − {ps['a']['name']}")  # the aggregate stands out
    ax.axvline(0, color="black", linewidth=0.8)
    ax.set_yticks(range(len(labels)), labels[::-1])
    ax.set(xlabel=f"Δ centred accuracy (95% CI; hollow: fewer than {stats.MIN_UNITS} items, no interval)",
           title="CORE deltas per task against the first run")
    ax.legend(fontsize=8)
    save_figure(fig, ax, out_dir, "core_deltas.png", "CORE deltas per task with 95% intervals", figures)


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


def step_plot(runs, out_dir, figures):
    """base_eval's val bpb and CORE at every evaluated step, one point per step; a partial CORE is hollow."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator
    if not several_steps(runs):
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    for k, r in enumerate(runs):
        color = f"C{k % 10}"
        bpb = [(step, rec["val_bpb"]) for step, rec in r["history"] if rec.get("val_bpb") is not None]
        if bpb:
            left.plot(*zip(*bpb), color=color, marker="o", label=r["name"])
        core = [(step, core_value(rec), rec.get("interrupted")) for step, rec in r["history"] if core_value(rec)]
        if core:
            right.plot([s for s, _, _ in core], [c[0] for _, c, _ in core], color=color, label=r["name"])
            for step, (score, n, full), cut in core:
                right.plot(step, score, "o", color=color, markerfacecolor=color if full else "none")
                if not full:
                    right.annotate(f"{n}/{NUM_CORE_TASKS}" + (" interrupted" if cut else ""), (step, score), fontsize=7,
                                   textcoords="offset points", xytext=(4, 4))
    left.set(xlabel="step", ylabel="val bits per byte", title="val bpb (base_eval) per evaluated step")
    right.set(xlabel="step", ylabel="CORE (centred)", title=f"CORE per evaluated step (hollow: partial, tasks of {NUM_CORE_TASKS})")
    for ax in (left, right):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if ax.lines:
            ax.legend(fontsize=8)
    right.grid(alpha=0.3)
    save_figure(fig, left, out_dir, "eval_vs_step.png", "val bpb and CORE at every evaluated step (hollow: partial CORE)", figures)


def steps_section(runs, figures):
    """Every evaluated step of every run: val bpb and CORE, a partial or interrupted CORE said so."""
    rows = []
    for r in runs:
        for step, rec in r["history"]:
            core = core_value(rec)
            if core is None:
                cell = "—"
            elif core[2]:
                cell = f"{core[0]:.4f}"
            else:
                cut = ", interrupted" if rec.get("interrupted") else ""
                cell = f"{core[0]:.4f} (partial, {core[1]}/{NUM_CORE_TASKS}{cut})"
            rows.append([f"`{r['name']}`", f"{step:,}", fmt(rec.get("val_bpb")), cell])
    text = "## Evaluated steps\n\n" + table(["run", "step", "val bpb", "CORE"], rows)
    if "eval_vs_step.png" in figures:
        text += f"\n\n![{figures['eval_vs_step.png']}](eval_vs_step.png)"
    return text + "\n"


def make_figures(runs, out_dir, beta, pairs=()):
    """{file name: caption} of the figures written into out_dir."""
    import matplotlib
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    figures = {}
    colors = [f"C{i % 10}" for i in range(len(runs))]

    fig, ax = plt.subplots(figsize=(8, 5))
    for r, c in zip(runs, colors):
        x, y = loss_curve(r)
        if x:
            ax.plot(x, y, color=c, alpha=0.2, linewidth=0.8)
            ax.plot(x, ema(y, beta), color=c, linewidth=1.8, label=f"{r['name']} (EMA β={beta:g})")
    ax.set(xlabel="training FLOPs", ylabel="train loss (nats/token)", title="Train loss vs training FLOPs (faint: raw)")
    ax.legend()
    save_figure(fig, ax, out_dir, "train_loss_vs_flops.png", "Train loss vs training FLOPs", figures)

    val_points = [(r, c, [(row["flops"], row["val_bpb"]) for row in r["metrics"] if row.get("val_bpb") is not None and row.get("flops") is not None])
                  for r, c in zip(runs, colors)]
    if any(pts for _, _, pts in val_points):  # runs trained with --eval-every -1 log no val bpb: no empty figure
        fig, ax = plt.subplots(figsize=(8, 5))
        for r, c, pts in val_points:
            if pts:
                ax.plot(*zip(*pts), color=c, marker="o", markersize=3, label=r["name"])
        ax.set(xlabel="training FLOPs", ylabel="val bits per byte", title="Validation bpb vs training FLOPs")
        ax.legend()
        save_figure(fig, ax, out_dir, "val_bpb_vs_flops.png", "Validation bpb vs training FLOPs", figures)

    gated = [(r, [row for row in r["metrics"] if isinstance(row.get("gate"), dict)]) for r in runs]
    gated = [(r, rows) for r, rows in gated if rows]
    if gated:
        styles = ["-", "--", ":", "-."]
        fig, ax = plt.subplots(figsize=(8, 5))
        for k, (r, rows) in enumerate(gated):
            steps = [row["step"] for row in rows]
            quartiles = list(zip(*[row["gate"]["gain_by_depth_quartile"] for row in rows]))
            for q, vals in enumerate(quartiles):
                ax.plot(steps, vals, color=plt.cm.viridis(q / max(1, len(quartiles) - 1)), linestyle=styles[k % 4],
                        label=f"{r['name']} depth quartile {q + 1}")
        ax.set(xlabel="step", ylabel="mean realised gain |g|", title="NAG realised gain by depth quartile (1 = shallowest)")
        ax.legend(fontsize=8)
        save_figure(fig, ax, out_dir, "gate_gain_by_depth.png", "NAG realised gain by depth quartile", figures)

        fig, ax = plt.subplots(figsize=(8, 5))
        for k, (r, rows) in enumerate(gated):
            g = rows[-1]["gate"]
            ax.step([row["step"] for row in rows], [row["gate"]["dead_branches"] for row in rows], where="post",
                    color=colors[runs.index(r)], label=f"{r['name']} (of {g.get('num_branches', '?')}, |g| < {g.get('dead_threshold', '?')})")
        ax.set(xlabel="step", ylabel="dead branches", title="NAG dead branches (mean |g| below threshold)")
        most = max(row["gate"]["dead_branches"] for _, rows in gated for row in rows)
        ax.set_ylim(-0.2, most + 1)  # counts: integer ticks, and a line at 0 stays visible above the axis
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend()
        save_figure(fig, ax, out_dir, "gate_dead_branches.png", "NAG dead-branch count", figures)
    forest_plot(pairs, out_dir, figures)
    step_plot(runs, out_dir, figures)
    mod_curve_plot(runs, out_dir, figures)
    step_time_plot(runs, out_dir, figures)
    return figures


def time_shares(run):
    """{part: its mean share of a logged step's time} over the rows with a breakdown (metrics.jsonl `time`, docs/runs.md),
    or None for a run trained before base_train measured one. Each row counts once, whatever interval it covers."""
    rows = [r["time"] for r in run["metrics"] if isinstance(r.get("time"), dict) and sum(r["time"].values()) > 0]
    if not rows:
        return None
    return {p: sum(t.get(p, 0.0) / sum(t.values()) for t in rows) / len(rows) for p in PHASES}


def step_time_plot(runs, out_dir, figures):
    """One stacked bar per run: the mean share of each part of a logged step."""
    import matplotlib.pyplot as plt
    shares = [(r, time_shares(r)) for r in runs]
    shares = [(r, s) for r, s in shares if s]
    if not shares:
        return
    fig, ax = plt.subplots(figsize=(2.5 + 1.2 * len(shares), 4.5))
    x = range(len(shares))
    bottom = [0.0] * len(shares)
    for k, phase in enumerate(PHASES):
        h = [100 * s[phase] for _, s in shares]
        ax.bar(x, h, bottom=bottom, width=0.6, color=f"C{k}", label=LABELS[phase])
        for i, (b, v) in enumerate(zip(bottom, h)):
            if v >= 4:  # a label only where it fits
                ax.text(i, b + v / 2, f"{v:.0f}%", ha="center", va="center", fontsize=8, color="white")
        bottom = [b + v for b, v in zip(bottom, h)]
    ax.set_xticks(list(x), [r["name"] for r, _ in shares])
    ax.set(ylabel="share of a logged step's time (%)", ylim=(0, 100), title="Where the step time went (mean over logged steps)")
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1, 0.5))
    save_figure(fig, ax, out_dir, "step_time.png", "Step time breakdown: mean share of each part per logged step", figures)


def step_time_section(runs, figures):
    shares = [(r, time_shares(r)) for r in runs]
    if not any(s for _, s in shares):
        return ""
    rows = [[LABELS[p]] + [f"{100 * s[p]:.1f}%" if s else "—" for _, s in shares] for p in PHASES]
    text = ("## Step time\n\nMean share of each part of a logged step (metrics.jsonl `time`, docs/runs.md); `save` is the "
            "checkpoint written after the previous row.\n\n" + table(["part"] + [f"`{r['name']}`" for r, _ in shares], rows))
    if "step_time.png" in figures:
        text += f"\n\n![{figures['step_time.png']}](step_time.png)"
    return text + "\n"


def mod_curves(runs):
    return [(r, r["eval"]["mod_curve"]) for r in runs if r["eval"] and r["eval"].get("mod_curve")]


def mod_curve_plot(runs, out_dir, figures):
    """base_eval --mod-rate: val bpb against the target skip rate and against the forward FLOPs executed."""
    import matplotlib.pyplot as plt
    curves = mod_curves(runs)
    if not curves:
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
    for r, c in curves:
        pts = c["points"]
        label = f"{r['name']} ({c['blocks']})"
        a.plot([100 * p["rate"] for p in pts], [p["val_bpb"] for p in pts], marker="o", label=label)
        b.plot([100 * p["flops_frac"] for p in pts], [p["val_bpb"] for p in pts], marker="o", label=label)
    a.set(xlabel="target skip rate (%)", ylabel="val bits per byte", title="MoD at inference: bpb vs skip rate")
    b.set(xlabel="forward FLOPs executed (% of full depth)", title="bpb vs FLOPs executed")
    b.invert_xaxis()
    a.legend(fontsize=8)
    b.grid(alpha=0.3)
    save_figure(fig, a, out_dir, "mod_curve.png", "MoD inference trade-off: val bpb vs skip rate and vs FLOPs executed", figures)


def mod_section(runs, figures):
    curves = mod_curves(runs)
    if not curves:
        return ""
    def delta(p, key):  # a point's cost against full depth, paired on the same val batches / CORE items
        if f"{key}_delta" not in p:
            return "—"
        lo, hi = p[f"{key}_delta_ci"]
        return f"{p[f'{key}_delta']:+.4f} ({lo:+.4f} … {hi:+.4f})"

    rows = [[f"`{r['name']}`", c["blocks"], f"{100 * p['rate']:.0f}%", fmt(p["val_bpb"]), delta(p, "val_bpb"), f"{100 * p.get('skip_attn', 0):.1f}%",
             f"{100 * p.get('skip_mlp', 0):.1f}%", f"{100 * p['flops_frac']:.1f}%", fmt(p.get("core")), delta(p, "core")]
            for r, c in curves for p in c["points"]]
    text = ("## Mixture-of-Depths at inference\n\nThresholds calibrated on train-split tokens at each rate, then fixed "
            "(base_eval --mod-rate). Δ: against the same model at full depth, with a 95% interval over the shared val "
            "batches / CORE items.\n\n" + table(["run", "blocks", "target", "val bpb", "Δ val bpb", "skipped attn", "skipped mlp",
                                                   "forward FLOPs", "CORE", "Δ CORE"], rows))
    if "mod_curve.png" in figures:
        text += f"\n\n![{figures['mod_curve.png']}](mod_curve.png)\n"
    return text


# ---------------------------------------------------------------------------


def compare(run_args, out_dir=None, beta=0.95):
    if not 0 <= beta < 1:
        raise UserError(f"--ema must be in [0, 1), got {beta}")
    runs = [load_run(a) for a in run_args]
    seen = {}
    for r in runs:  # two runs of the same name (from different base dirs) still get distinct columns
        seen[r["name"]] = seen.get(r["name"], 0) + 1
        if seen[r["name"]] > 1:
            r["name"] = f"{r['name']}#{seen[r['name']]}"
    inputs = report_inputs([r["dir"] for r in runs])
    if out_dir is None:  # named after the runs and steps only: it must not replace a report of other inputs
        out_dir = default_out_dir(runs)
        check_report_folder(out_dir, inputs)
    pairs = [pair_stats(runs[0], r) for r in runs[1:]]  # before any output: refused pairs write nothing
    ensure_writable_dir(out_dir)
    atomic_write_json(os.path.join(out_dir, INPUTS), inputs)  # first: a report cut short is still known as of these inputs
    figures = make_figures(runs, out_dir, beta, pairs)

    title = " vs ".join(f"`{r['name']}`" for r in runs)
    parts = [f"# {title}", "\n".join(f"- `{r['name']}` ({r['config'].get('arch', '?')}): {r['dir']}" for r in runs),
             summary_section(runs, beta), measured_section(runs, pairs), config_section(runs), core_section(runs)]
    if pairs:
        parts.append(significance_section(pairs))
        if "core_deltas.png" in figures:
            parts[-1] += f"\n![{figures['core_deltas.png']}](core_deltas.png)\n"
    if several_steps(runs):
        parts.append(steps_section(runs, figures))
    curves = [f"![{cap}]({name})" for name, cap in figures.items()
              if not name.startswith(("gate_", "core_deltas", "mod_", "eval_vs_step", "step_time"))]
    parts.append("## Training curves\n\n" + "\n\n".join(curves))
    gates = [f"![{cap}]({name})" for name, cap in figures.items() if name.startswith("gate_")]
    if gates:
        parts.append("## NAG gate telemetry\n\n" + "\n\n".join(gates))
    if mod_curves(runs):
        parts.append(mod_section(runs, figures))
    if step_time_section(runs, figures):
        parts.append(step_time_section(runs, figures))
    analysis = os.path.join(get_base_dir(), "reports", "analysis_" + "_vs_".join(os.path.basename(r["dir"]) for r in runs), "analysis.md")
    if os.path.exists(analysis):  # written by `python -m analysis` for the same runs
        rel = os.path.relpath(analysis, out_dir)
        parts.append(f"## Residual geometry, attention sinks, confidence\n\n[{rel}]({rel}) (`python -m analysis`)")
    note = notes(runs, figures)
    if note:
        parts.append(note)
    report = os.path.join(out_dir, "report.md")
    atomic_write_bytes(report, ("\n\n".join(p.rstrip("\n") for p in parts) + "\n").encode())
    print(parts[2])  # the side-by-side summary (steps, tokens, FLOPs, loss, bpb, CORE), what differs, the verdicts, then where the rest is
    warnings = [f"warning: {line}" for ps in pairs for line in difference_lines(ps)]
    for line in warnings + [s for ps in pairs for s in ps["sentences"]] + [n for r in runs for n in r["notes"]]:
        print(line)
    print(f"\nreport with figures: {report}")
    return report


def main(argv=None):
    p = argparse.ArgumentParser(description="Compare training runs (e.g. a FLOP-matched GPT / NAG pair): report.md + figures.")
    p.add_argument("runs", nargs="*", metavar="RUN", help="run name under $NANOCHAT_BASE_DIR/runs, or a path to a run directory")
    p.add_argument("--a", nargs="+", metavar="RUN", default=None, help="group a: runs of one model that differ only in their seeds")
    p.add_argument("--b", nargs="+", metavar="RUN", default=None, help="group b, compared with group a (scripts/compare_groups.py)")
    p.add_argument("--out", type=str, default=None, help="output directory, replacing a report there (default: $NANOCHAT_BASE_DIR/reports/"
                   "<run1>@<step>_vs_<run2>@<step>, never replacing a report of other inputs)")
    p.add_argument("--ema", type=float, default=0.95, help="EMA factor that smooths the train loss curve")
    args = p.parse_args(argv)
    if args.a is not None or args.b is not None:  # two groups of seeds: their own report
        if args.a is None or args.b is None or args.runs:
            p.error("give both --a RUN... and --b RUN..., and no positional runs")
        from scripts.compare_groups import compare_groups  # imports base_train's settings list only when asked for
        with exit_on_user_error():
            return compare_groups(args.a, args.b, args.out)
    if not args.runs:
        p.error("give the runs to compare, or two groups with --a RUN... --b RUN...")
    with exit_on_user_error():
        return compare(args.runs, args.out, args.ema)


if __name__ == "__main__":
    main()
