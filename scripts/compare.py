"""
Compare training runs, typically a FLOP-matched GPT / NAG pair: one markdown report plus figures.

    python -m scripts.compare gpt-d20 nag-d20
    python -m scripts.compare ~/.cache/nanochat/runs/gpt-d20 nag-d20 --out /tmp/report

Each RUN is a run name under $NANOCHAT_BASE_DIR/runs or a path to a run directory. Reads
config.json, metrics.jsonl and (if base_eval has run) eval.json of each; writes report.md and PNG
figures into --out (default $NANOCHAT_BASE_DIR/reports/<run1>_vs_<run2>).
"""

import io
import os
import json
import argparse

from nanochat.common import UserError, exit_on_user_error, get_base_dir, atomic_write_bytes
from nanochat.checkpoint_manager import resolve_run_dir, get_run_dir
from nanochat.core_eval import NUM_CORE_TASKS

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
    """The rows of metrics.jsonl; a line that is not a JSON object with a step is an error naming the line."""
    if not os.path.exists(path):
        raise UserError(f"{path} is missing; is {os.path.dirname(path)} a run directory written by scripts.base_train?")
    rows = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                row = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError):
                raise UserError(f"{path} line {lineno}: malformed JSON") from None
            if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                raise UserError(f"{path} line {lineno}: expected a JSON object with an integer step")
            rows.append(row)
    if not rows:
        raise UserError(f"{path} has no rows; the run logged no step")
    return rows


def load_run(arg):
    run_dir = existing_run_dir(arg)
    cfg_path = os.path.join(run_dir, "config.json")
    if not os.path.exists(cfg_path):
        raise UserError(f"{cfg_path} is missing; is {run_dir} a run directory written by scripts.base_train?")
    config = read_json(cfg_path)
    eval_path = os.path.join(run_dir, "eval.json")
    return {
        "dir": run_dir,
        "name": config.get("run") or os.path.basename(run_dir),
        "config": config,
        "metrics": read_metrics(os.path.join(run_dir, "metrics.jsonl")),
        "eval": read_json(eval_path) if os.path.exists(eval_path) else None,
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
    """CLI args (as --flags), model_config.* and nag_config.* of one run."""
    out = {f"--{k.replace('_', '-')}": v for k, v in (config.get("args") or {}).items() if k not in SKIP_ARGS}
    for section in ("model_config", "nag_config"):
        out.update({f"{section}.{k}": v for k, v in (config.get(section) or {}).items()})
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


def notes(runs, figures):
    lines = []
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


def make_figures(runs, out_dir, beta):
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

    fig, ax = plt.subplots(figsize=(8, 5))
    for r, c in zip(runs, colors):
        pts = [(row["flops"], row["val_bpb"]) for row in r["metrics"] if row.get("val_bpb") is not None and row.get("flops") is not None]
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
    return figures


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
    os.makedirs(out_dir, exist_ok=True)
    figures = make_figures(runs, out_dir, beta)

    title = " vs ".join(f"`{r['name']}`" for r in runs)
    parts = [f"# {title}", "\n".join(f"- `{r['name']}` ({r['config'].get('arch', '?')}): {r['dir']}" for r in runs),
             summary_section(runs, beta), config_section(runs), core_section(runs)]
    curves = [f"![{cap}]({name})" for name, cap in figures.items() if not name.startswith("gate_")]
    parts.append("## Training curves\n\n" + "\n\n".join(curves))
    gates = [f"![{cap}]({name})" for name, cap in figures.items() if name.startswith("gate_")]
    if gates:
        parts.append("## NAG gate telemetry\n\n" + "\n\n".join(gates))
    analysis = os.path.join(get_base_dir(), "reports", "analysis_" + "_vs_".join(os.path.basename(r["dir"]) for r in runs), "analysis.md")
    if os.path.exists(analysis):  # written by `python -m analysis` for the same runs
        rel = os.path.relpath(analysis, out_dir)
        parts.append(f"## Residual geometry, attention sinks, confidence\n\n[{rel}]({rel}) (`python -m analysis`)")
    note = notes(runs, figures)
    if note:
        parts.append(note)
    report = os.path.join(out_dir, "report.md")
    atomic_write_bytes(report, ("\n\n".join(p.rstrip("\n") for p in parts) + "\n").encode())
    print(parts[2])  # the side-by-side summary (steps, tokens, FLOPs, loss, bpb, CORE), then where the rest is
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
