"""
Compare training runs, typically a FLOP-matched GPT / NAG pair: one markdown report plus figures.

    python -m scripts.compare gpt-tiny nag-tiny
    python -m scripts.compare gpt-tiny nag-tiny --out /tmp/nag-chat-report

Each RUN is a run name under $NANOCHAT_BASE_DIR/runs or a path to a run directory. Reads
config.json, metrics.jsonl and (if base_eval has run) eval.json and core_records.parquet of each;
writes report.md and PNG figures into --out (default $NANOCHAT_BASE_DIR/reports/<run1>_vs_<run2>).

Every delta against the first run comes with a paired 95% bootstrap interval (nanochat/stats.py):
CORE resampled over items within each task, val bpb over the shared evaluation batches. Runs
evaluated on different CORE items or settings are refused: their scores do not compare.
"""

import io
import os
import json
import argparse

from nanochat.common import UserError, exit_on_user_error, get_base_dir, atomic_write_bytes
from nanochat.checkpoint_manager import resolve_run_dir, get_run_dir
from nanochat.core_eval import NUM_CORE_TASKS, load_records
from nanochat import stats

N_RESAMPLES = 10000

SKIP_ARGS = {"run"}  # differs by construction; the report's columns already name the runs


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


def load_run(arg):
    run_dir = existing_run_dir(arg)
    cfg_path = os.path.join(run_dir, "config.json")
    if not os.path.exists(cfg_path):
        raise UserError(f"{cfg_path} is missing; is {run_dir} a run directory written by scripts.base_train?")
    config = read_json(cfg_path)
    eval_path = os.path.join(run_dir, "eval.json")
    metrics, notes = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    ev = read_json(eval_path) if os.path.exists(eval_path) else None
    return {
        "dir": run_dir,
        "name": config.get("run") or os.path.basename(run_dir),
        "config": config,
        "metrics": metrics,
        "eval": ev,
        "records": load_core_records(run_dir, ev),
        "notes": notes,
    }


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
    return "— (partial only)", f"{ev['partial_core']:.4f} ({n}/{NUM_CORE_TASKS})"


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
    """The verdict in words: the delta, its interval, and whether it stands out of the noise."""
    lo, hi = r["ci"]
    call = "distinguishable from noise" if lo > 0 or hi < 0 else "not distinguishable from noise"
    return f"{b} − {a} {what} = {r['delta']:+.4f} (95% CI {lo:+.4f} … {hi:+.4f}, p = {r['p']:.3g}): {call} {where}"


def pair_stats(a, b):
    """Intervals of run b against run a: CORE (with per-task deltas) and val bpb, each where both runs
    have what it needs; `sentences` says what was found, `notes` why something is missing."""
    out = {"a": a, "b": b, "core": None, "bpb": None, "sentences": [], "notes": []}
    if a["records"] and b["records"]:
        check_same_items(a, b)
        (cols_a, settings), (cols_b, _) = a["records"], b["records"]
        r = stats.core_delta_interval(cols_a, cols_b, settings, n_resamples=N_RESAMPLES, seed=0)
        T = len(settings["tasks"])
        full = T == NUM_CORE_TASKS and a["eval"].get("core_metric") is not None and b["eval"].get("core_metric") is not None
        r["label"] = "CORE" if full else f"partial CORE ({T}/{NUM_CORE_TASKS})"
        # the smallest difference this evaluation resolves, from how often the two runs disagree per task
        disc, sizes, bases = {}, {}, {}
        for label, info in settings["tasks"].items():
            ca = {i: c for t, i, c in zip(cols_a["task"], cols_a["idx"], cols_a["correct"]) if t == label}
            cb = {i: c for t, i, c in zip(cols_b["task"], cols_b["idx"], cols_b["correct"]) if t == label}
            disc[label] = sum(ca[i] != cb[i] for i in ca) / len(ca)
            sizes[label], bases[label] = len(ca), info["random_baseline"]
        r["mde"], r["se"] = stats.min_detectable_core_diff(sizes, bases, discordance=disc)
        out["core"] = r
        out["sentences"].append(sentence(a["name"], b["name"], r["label"], r, f"at {items_text(r['tasks'])}"))
    elif (a["eval"] or {}).get("tasks") or (b["eval"] or {}).get("tasks"):
        out["notes"].append("only one of the runs has CORE results: no CORE interval")
    va, vb = (a["eval"] or {}).get("val_batches"), (b["eval"] or {}).get("val_batches")
    if va and vb and va.get("bytes") == vb.get("bytes"):
        r = stats.bpb_delta_interval(va["nats"], vb["nats"], va["bytes"], n_resamples=N_RESAMPLES, seed=0)
        out["bpb"] = r
        out["sentences"].append(sentence(a["name"], b["name"], "val bpb", r, f"on {r['batches']} shared val batches (lower is better)"))
    elif va and vb:
        out["notes"].append("the runs' val bpb was measured on different batches (other --split-tokens, batch size or "
                            "sequence length): no bpb interval")
    elif (a["eval"] or {}).get("val_bpb") is not None and (b["eval"] or {}).get("val_bpb") is not None:
        out["notes"].append("an eval.json without per-batch val losses (from before they were kept): no bpb interval; rerun base_eval")
    return out


def significance_section(pairs):
    out = ["## Is the difference real? (paired 95% bootstrap intervals)"]
    for ps in pairs:
        a, b = ps["a"]["name"], ps["b"]["name"]
        out.append(f"### `{b}` vs `{a}`")
        out.append("\n".join(f"- {s}" for s in ps["sentences"] + [f"no interval: {n}" for n in ps["notes"]]) or "Nothing to compare.")
        r = ps["core"]
        if r is None:
            continue
        rows = []
        for label, t in r["tasks"].items():
            mark = " \\*" if t["ci"][0] > 0 or t["ci"][1] < 0 else ""
            rows.append([f"`{label}`", f"{t['delta']:+.4f}{mark}", f"{t['ci'][0]:+.4f} … {t['ci'][1]:+.4f}", f"{t['p']:.3g}",
                         f"{t['se_a']:.4f}", f"{t['se_b']:.4f}", t["n"]])
        mark = " \\*" if r["ci"][0] > 0 or r["ci"][1] < 0 else ""
        rows.append([f"**{r['label']}**", f"{r['delta']:+.4f}{mark}", f"{r['ci'][0]:+.4f} … {r['ci'][1]:+.4f}", f"{r['p']:.3g}", "", "", ""])
        out.append(table(["task", f"Δ centred (`{b}` − `{a}`)", "95% CI", "p", f"SE `{a}`", f"SE `{b}`", "items"], rows))
        out.append(f"\\* the 95% interval excludes 0. Items are resampled within each task ({N_RESAMPLES:,} resamples, seed 0); "
                   f"SE is one run's standard error of the centred accuracy. With these items and how often the two runs "
                   f"disagree, the smallest {r['label']} difference found 80% of the time at the 5% level is "
                   f"±{r['mde']:.4f} (SE {r['se']:.4f}).")
    return "\n\n".join(out) + "\n"


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
            lines.append(f"`{name}`: CORE was scored on {ev.get('num_tasks_scored')} of {NUM_CORE_TASKS} tasks, so only a "
                         f"partial CORE is shown (missing: {missing}).")
        if not ev.get("tasks") and ev.get("core_error"):
            lines.append(f"`{name}`: CORE was not evaluated ({ev['core_error']}).")
        if ev.get("step") != r["metrics"][-1]["step"]:
            lines.append(f"`{name}`: eval.json is of step {ev.get('step')}, the training log ends at step {r['metrics'][-1]['step']}.")
        if (ev.get("max_per_task") or -1) > 0 and ev.get("tasks"):
            lines.append(f"`{name}`: CORE used at most {ev['max_per_task']} examples per task, a subset of the full protocol.")
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
        r = ps["core"]
        rows = [r["tasks"][t] for t in labels[:-1]] + [r]
        y = [len(labels) - 1 - i + 0.15 * (k - (len(pairs) - 1) / 2) for i in range(len(labels))]
        d = [x["delta"] for x in rows]
        err = [[x["delta"] - x["ci"][0] for x in rows], [x["ci"][1] - x["delta"] for x in rows]]
        ax.errorbar(d, y, xerr=err, fmt="o", color=f"C{(k + 1) % 10}", capsize=3, label=f"{ps['b']['name']} − {ps['a']['name']}")
        ax.plot(d[-1], y[-1], "D", color=f"C{(k + 1) % 10}", markersize=9)  # the aggregate stands out
    ax.axvline(0, color="black", linewidth=0.8)
    ax.set_yticks(range(len(labels)), labels[::-1])
    ax.set(xlabel="Δ centred accuracy (95% CI)", title="CORE deltas per task against the first run")
    ax.legend(fontsize=8)
    save_figure(fig, ax, out_dir, "core_deltas.png", "CORE deltas per task with 95% intervals", figures)


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
    mod_curve_plot(runs, out_dir, figures)
    return figures


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
    out_dir = out_dir or os.path.join(get_base_dir(), "reports", "_vs_".join(r["name"] for r in runs))
    pairs = [pair_stats(runs[0], r) for r in runs[1:]]  # before any output: refused pairs write nothing
    os.makedirs(out_dir, exist_ok=True)
    figures = make_figures(runs, out_dir, beta, pairs)

    title = " vs ".join(f"`{r['name']}`" for r in runs)
    parts = [f"# {title}", "\n".join(f"- `{r['name']}` ({r['config'].get('arch', '?')}): {r['dir']}" for r in runs),
             summary_section(runs, beta), config_section(runs), core_section(runs)]
    if pairs:
        parts.append(significance_section(pairs))
        if "core_deltas.png" in figures:
            parts[-1] += f"\n![{figures['core_deltas.png']}](core_deltas.png)\n"
    curves = [f"![{cap}]({name})" for name, cap in figures.items() if not name.startswith(("gate_", "core_deltas", "mod_"))]
    parts.append("## Training curves\n\n" + "\n\n".join(curves))
    gates = [f"![{cap}]({name})" for name, cap in figures.items() if name.startswith("gate_")]
    if gates:
        parts.append("## NAG gate telemetry\n\n" + "\n\n".join(gates))
    if mod_curves(runs):
        parts.append(mod_section(runs, figures))
    analysis = os.path.join(get_base_dir(), "reports", "analysis_" + "_vs_".join(os.path.basename(r["dir"]) for r in runs), "analysis.md")
    if os.path.exists(analysis):  # written by `python -m analysis` for the same runs
        rel = os.path.relpath(analysis, out_dir)
        parts.append(f"## Residual geometry, attention sinks, confidence\n\n[{rel}]({rel}) (`python -m analysis`)")
    note = notes(runs, figures)
    if note:
        parts.append(note)
    report = os.path.join(out_dir, "report.md")
    atomic_write_bytes(report, ("\n\n".join(p.rstrip("\n") for p in parts) + "\n").encode())
    print(parts[2])  # the side-by-side summary (steps, tokens, FLOPs, loss, bpb, CORE), the verdicts, then where the rest is
    for line in [s for ps in pairs for s in ps["sentences"]] + [n for r in runs for n in r["notes"]]:
        print(line)
    print(f"\nreport with figures: {report}")
    return report


def main(argv=None):
    p = argparse.ArgumentParser(description="Compare training runs (e.g. a FLOP-matched GPT / NAG pair): report.md + figures.")
    p.add_argument("runs", nargs="+", metavar="RUN", help="run name under $NANOCHAT_BASE_DIR/runs, or a path to a run directory")
    p.add_argument("--out", type=str, default=None, help="output directory (default: $NANOCHAT_BASE_DIR/reports/<run1>_vs_<run2>)")
    p.add_argument("--ema", type=float, default=0.95, help="EMA factor that smooths the train loss curve")
    args = p.parse_args(argv)
    with exit_on_user_error():
        return compare(args.runs, args.out, args.ema)


if __name__ == "__main__":
    main()
