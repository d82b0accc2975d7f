"""
The report's markdown: cells and tables, the verdicts in words, and the sections of a pair's report.
"""

import os
import json

from nanochat.run_dir import run_path
from nanochat.core_eval import NUM_CORE_TASKS
from nanochat.step_timer import PHASES, LABELS
from nanochat import stats
from nag.archs import is_nag_arch
from analysis.compare.runs import (
    versions_note,
    N_RESAMPLES,
    MEASURED_WITH,
    KEY_NAMES,
    FINGERPRINTS,
    ema,
    loss_curve,
    last_logged,
    flat_config,
    core_value,
    time_shares,
    mod_curves,
    measured_with,
)


# ---------------------------------------------------------------------------
# cells, tables and sentences


def fmt_count(n):
    if n is None:
        return "—"
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:g}"


def fmt(x, spec=".4f"):
    return "—" if x is None else format(x, spec)


def value_cell(v):
    """A config value as a markdown table cell."""
    if v is None:
        return "—"
    text = v if isinstance(v, str) else json.dumps(v)
    return (text or '""').replace("|", "\\|").replace("\n", " ")


def table(header, rows, align=None):
    align = align or ["---"] + ["---:"] * (len(header) - 1)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def core_cells(ev):
    """(CORE cell, partial CORE cell) of one eval.json. A partial score is never shown as CORE."""
    if ev is None or not ev.get("tasks"):
        return "—", "—"
    n = ev.get("num_tasks_scored", len(ev["tasks"]))
    if ev.get("core_metric") is not None:
        return f"{ev['core_metric']:.4f}", f"{ev['core_metric']:.4f} ({n}/{NUM_CORE_TASKS})"
    cut = ", interrupted" if ev.get("interrupted") else ""
    return "— (partial only)", f"{ev['partial_core']:.4f} ({n}/{NUM_CORE_TASKS}{cut})"


def items_text(task_stats):
    sizes = {t["n"] for t in task_stats.values()}
    return (
        f"{sizes.pop()} items per task"
        if len(sizes) == 1
        else f"{sum(t['n'] for t in task_stats.values()):,} items over {len(task_stats)} tasks"
    )


def p_text(p):
    """A resampled p-value in words: below 1/N (N resamples) it cannot be told apart from smaller ones, so never "=
    0"."""
    return f"< 1/{N_RESAMPLES}" if p < 1 / N_RESAMPLES else f"= {p:.3g}"


def verdict_sentence(a, b, what, r, where):
    """The verdict in words: the delta, its interval, and whether it stands out of the noise; without
    enough units (stats.MIN_UNITS) the delta alone and why there is no interval."""
    if r.get("too_few"):  # the delta, but no interval, p-value or verdict
        return f"{b} − {a} {what} = {r['delta']:+.4f}: {r['too_few']}"
    lo, hi = r["ci"]
    call = "distinguishable from noise" if lo > 0 or hi < 0 else "not distinguishable from noise"
    return f"{b} − {a} {what} = {r['delta']:+.4f} (95% CI {lo:+.4f} … {hi:+.4f}, p {p_text(r['p'])}): {call} {where}"


def interval_cells(r):
    """Δ (starred where the interval excludes 0), interval and p cells of one row; too few items: the reason."""
    if r.get("too_few"):
        return [f"{r['delta']:+.4f}", r["too_few"], "—"]
    mark = " \\*" if r["ci"][0] > 0 or r["ci"][1] < 0 else ""
    return [f"{r['delta']:+.4f}{mark}", f"{r['ci'][0]:+.4f} … {r['ci'][1]:+.4f}", p_text(r["p"]).removeprefix("= ")]


# ---------------------------------------------------------------------------
# report sections


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
    col.update(
        {
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
        }
    )
    return col


def summary_section(runs, beta):
    first_flops = runs[0]["metrics"][-1].get("flops") if len(runs) > 1 else None
    cols = [summary_column(r, beta, first_flops) for r in runs]
    rows = [[label, *[c.get(label, "—") for c in cols]] for label in cols[0]]
    return "## Summary\n\n" + table(["", *[f"`{r['name']}`" for r in runs]], rows)


def difference_lines(ps):
    """The pair's differences in what its numbers were measured with, and what could not be checked, in words."""
    a, b = ps["a"]["name"], ps["b"]["name"]
    lines = []
    if ps["differ"]:
        what = "; ".join(f"{label} ({text})" for label, text in ps["differ"].items())
        lines.append(f"`{b}` vs `{a}` differ in {what}")
        if "training data" in ps["differ"]:
            lines.append(
                f"`{b}` and `{a}` were trained on different data: their "
                "differences mix the architecture with the corpus"
            )
        if "training processes" in ps["differ"]:
            lines.append(
                f"`{b}` and `{a}` were trained with different numbers of processes: NAG gate telemetry and the "
                "training log's val bpb are measured per process count and do not compare exactly"
            )
    if ps["unknown"]:
        runs = sorted({n for names in ps["unknown"].values() for n in names})
        lines.append(
            f"not recorded for {', '.join(f'`{n}`' for n in runs)} (written before compare could check them): "
            f"{', '.join(ps['unknown'])}; compare cannot tell whether `{b}` and `{a}` share them"
        )
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
    return out + table(
        ["setting", *[f"`{r['name']}`" for r in runs]],
        [[f"`{k}`", *[value_cell(f.get(k)) for f in flats]] for k in diff],
    )


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
        rows.append(
            [
                f"**mean over the {len(common)} tasks all runs scored**",
                *[f"{m:+.4f}" for m in means],
                *[f"{m - means[0]:+.4f}" for m in means[1:]],
            ]
        )
    out += table(header, rows)
    if base is None and len(runs) > 1:
        out += f"\n\nDeltas are against `{runs[0]['name']}`, which has no CORE results, so none are shown."
    return out + "\n"


def significance_section(pairs):
    out = ["## Is the difference real? (paired 95% bootstrap intervals)"]
    for ps in pairs:
        a, b = ps["a"]["name"], ps["b"]["name"]
        out.append(f"### `{b}` vs `{a}`")
        out.append(
            "\n".join(f"- {s}" for s in ps["verdicts"] + [f"no interval: {n}" for n in ps["no_interval"]])
            or "Nothing to compare."
        )
        r = ps["core"]
        if r is None:
            continue
        rows = [
            [f"`{label}`", *interval_cells(t), f"{t['se_a']:.4f}", f"{t['se_b']:.4f}", t["n"]]
            for label, t in r["tasks"].items()
        ]
        rows.append([f"**{r['label']}**", *interval_cells(r), "", "", ""])
        out.append(
            table(["task", f"Δ centred (`{b}` − `{a}`)", "95% CI", "p", f"SE `{a}`", f"SE `{b}`", "items"], rows)
        )
        out.append(
            f"\\* the 95% interval excludes 0. Items are resampled within each task ({N_RESAMPLES:,} resamples, seed "
            f"0), where a task has at least {stats.MIN_UNITS} (the aggregate: all items together); "
            f"SE is one run's standard error of the centred accuracy. With these items and how often the two runs "
            f"disagree, the smallest {r['label']} difference found 80% of the time at the 5% level is "
            f"±{r['mde']:.4f} (SE {r['se']:.4f})."
        )
    return "\n\n".join(out) + "\n"


def steps_section(runs, figures):
    """Every evaluated step of every run: val bpb and CORE, a partial or interrupted CORE said so."""
    rows = []
    for r in runs:
        for step, rec in r["history"]:
            core = core_value(rec)
            if core is None:
                core_text = "—"
            elif core[2]:
                core_text = f"{core[0]:.4f}"
            else:
                cut = ", interrupted" if rec.get("interrupted") else ""
                core_text = f"{core[0]:.4f} (partial, {core[1]}/{NUM_CORE_TASKS}{cut})"
            rows.append([f"`{r['name']}`", f"{step:,}", fmt(rec.get("val_bpb")), core_text])
    text = "## Evaluated steps\n\n" + table(["run", "step", "val bpb", "CORE"], rows)
    if "eval_vs_step.png" in figures:
        text += f"\n\n![{figures['eval_vs_step.png']}](eval_vs_step.png)"
    return text + "\n"


def step_time_section(runs, figures):
    shares = [(r, time_shares(r)) for r in runs]
    if not any(s for _, s in shares):
        return ""
    rows = [[LABELS[p]] + [f"{100 * s[p]:.1f}%" if s else "—" for _, s in shares] for p in PHASES]
    text = (
        "## Step time\n\nMean share of each part of a logged step (metrics.jsonl `time`, docs/runs.md); `save` is the "
        "checkpoint written after the previous row.\n\n" + table(["part"] + [f"`{r['name']}`" for r, _ in shares], rows)
    )
    if "step_time.png" in figures:
        text += f"\n\n![{figures['step_time.png']}](step_time.png)"
    return text + "\n"


def mod_section(runs, figures):
    curves = mod_curves(runs)
    if not curves:
        return ""

    def delta(p, key):  # a point's cost against full depth, paired on the same val batches / CORE items
        if f"{key}_delta" not in p:
            return "—"
        lo, hi = p[f"{key}_delta_ci"]
        return f"{p[f'{key}_delta']:+.4f} ({lo:+.4f} … {hi:+.4f})"

    rows = [
        [
            f"`{r['name']}`",
            c["blocks"],
            f"{100 * p['rate']:.0f}%",
            fmt(p["val_bpb"]),
            delta(p, "val_bpb"),
            f"{100 * p.get('skip_attn', 0):.1f}%",
            f"{100 * p.get('skip_mlp', 0):.1f}%",
            f"{100 * p['flops_frac']:.1f}%",
            fmt(p.get("core")),
            delta(p, "core"),
        ]
        for r, c in curves
        for p in c["points"]
    ]
    text = (
        "## Mixture-of-Depths at inference\n\nThresholds calibrated on train-split tokens at each rate, then fixed "
        "(base_eval --mod-rate). Δ: against the same model at full depth, with a 95% interval over the shared val "
        "batches / CORE items.\n\n"
        + table(
            [
                "run",
                "blocks",
                "target",
                "val bpb",
                "Δ val bpb",
                "skipped attn",
                "skipped mlp",
                "forward FLOPs",
                "CORE",
                "Δ CORE",
            ],
            rows,
        )
    )
    if "mod_curve.png" in figures:
        text += f"\n\n![{figures['mod_curve.png']}](mod_curve.png)\n"
    return text


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
                lines.append(
                    f"`{r['name']}`: its evaluated steps differ in {KEY_NAMES[key]} "
                    f"({where}); its val bpb over steps mixes them."
                )
    return lines


def notes_section(runs, figures):
    lines = [n for r in runs for n in r["read_notes"]]
    for r in runs:
        name, ev = r["name"], r["eval"]
        if ev is None:
            where = name if os.path.normpath(run_path(name)) == r["dir"] else r["dir"]
            lines.append(
                f"`{name}` has no eval.json: its CORE and base_eval bpb are not shown "
                f"(run `python -m scripts.base_eval --run {where}`)."
            )
            continue
        if ev.get("tasks") and ev.get("core_metric") is None:
            missing = ", ".join(ev.get("missing_tasks") or []) or "none"
            why = ""
            if ev.get("interrupted"):  # base_eval resumes it at the first task not reached
                left = ", ".join(ev.get("interrupted_tasks") or []) or "not recorded"
                why = f"the CORE evaluation was interrupted (tasks not reached: {left}; rerun base_eval to resume it): "
            lines.append(
                f"`{name}`: {why}CORE was scored on {ev.get('num_tasks_scored')} of {NUM_CORE_TASKS} tasks, so only a "
                f"partial CORE is shown (missing: {missing})."
            )
        if not ev.get("tasks") and ev.get("core_error"):
            lines.append(f"`{name}`: CORE was not evaluated ({ev['core_error']}).")
        if ev.get("step") != r["metrics"][-1]["step"]:
            lines.append(
                f"`{name}`: eval.json is of step {ev.get('step')}, the "
                f"training log ends at step {r['metrics'][-1]['step']}."
            )
        if (ev.get("max_per_task") or -1) > 0 and ev.get("tasks"):
            lines.append(
                f"`{name}`: CORE used at most {ev['max_per_task']} examples per task, a subset of the full protocol."
            )
    lines += history_notes(runs)
    if versions_note(runs):
        lines.append(versions_note(runs) + ".")
    limits = {json.dumps(r["eval"].get("max_per_task")) for r in runs if r["eval"] and r["eval"].get("tasks")}
    if len(limits) > 1:
        lines.append("The runs' CORE scores used different --max-per-task limits and do not compare exactly.")
    if not any(name.startswith("gate_") for name in figures) and any(
        is_nag_arch(r["config"].get("arch")) for r in runs
    ):
        lines.append("No gate telemetry in the NAG runs' metrics.jsonl (trained with --nag-gate-log-every 0?).")
    return "## Notes\n\n" + "\n".join(f"- {line}" for line in lines) + "\n" if lines else ""
