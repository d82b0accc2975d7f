"""
The comparison of runs against the first one, typically a FLOP-matched GPT / NAG pair.

Paired 95% bootstrap
intervals of each delta (nanochat/stats.py), and compare(), which writes report.md, the figures and inputs.json.
"""

import os

from nanochat.common import UserError, get_base_dir, atomic_write_bytes
from nanochat.core_eval import NUM_CORE_TASKS
from nanochat.run_dir import load_run, read_manifest, folder_name, claim_folder, staging, publish
from nanochat import stats
from analysis.compare.runs import (
    versions_note,
    N_RESAMPLES,
    BPB_DEPENDS_ON,
    mod_curves,
    several_steps,
    pair_differences,
    check_same_items,
)
from analysis.compare.inputs import (
    TOOL,
    report_inputs,
    distinct_names,
    check_distinct,
    run_step,
    default_out_dir,
    check_report_folder,
    check_precision,
)
from analysis.compare.tables import (
    items_text,
    verdict_sentence,
    difference_lines,
    summary_section,
    measured_section,
    config_section,
    core_section,
    significance_section,
    steps_section,
    step_time_section,
    mod_section,
    notes_section,
)
from analysis.compare.figures import make_figures


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
    have what it needs; `verdicts` says what was found, `no_interval` why an interval is missing."""
    out = {"a": a, "b": b, "core": None, "bpb": None, "verdicts": [], "no_interval": []}
    out["differ"], out["unknown"] = pair_differences(a, b)
    if a["records"] and b["records"]:
        r = out["core"] = core_stats(a, b)
        out["verdicts"].append(verdict_sentence(a["name"], b["name"], r["label"], r, f"at {items_text(r['tasks'])}"))
    elif (a["eval"] or {}).get("tasks") or (b["eval"] or {}).get("tasks"):
        out["no_interval"].append("only one of the runs has CORE results: no CORE interval")
    ea, eb = a["eval"] or {}, b["eval"] or {}
    if ea.get("val_bpb") is None or eb.get("val_bpb") is None:
        return out
    va, vb = ea.get("val_batches"), eb.get("val_batches")
    both = (
        f"{b['name']} − {a['name']} val bpb = {eb['val_bpb'] - ea['val_bpb']:+.4f} "
        f"({a['name']} {ea['val_bpb']:.4f}, {b['name']} {eb['val_bpb']:.4f})"
    )
    refuse = [f"{label} ({out['differ'][label]})" for label in BPB_DEPENDS_ON if label in out["differ"]]
    if refuse:  # both numbers, and the true reason they do not pair
        out["verdicts"].append(f"{both}: no interval, the runs differ in {'; '.join(refuse)}")
    elif va.get("bytes") != vb.get("bytes"):
        unknown = [label for label in BPB_DEPENDS_ON if label in out["unknown"]]
        why = (
            f"{', '.join(unknown)} not recorded"
            if unknown
            else "with the same tokenizer, val data, val tokens and processes: "
            "another --device-batch-size or sequence length"
        )
        out["verdicts"].append(
            f"{both}: no interval, the runs' val batches differ ({len(va['nats'])} vs {len(vb['nats'])} batches, "
            f"other byte counts; {why})"
        )
    else:
        r = stats.bpb_delta_interval(va["nats"], vb["nats"], va["bytes"], n_resamples=N_RESAMPLES, seed=0)
        r["too_few"] = stats.too_few_units(r["batches"], "batches")
        out["bpb"] = r
        out["verdicts"].append(
            verdict_sentence(
                a["name"], b["name"], "val bpb", r, f"on {r['batches']} shared val batches (lower is better)"
            )
        )
    return out


def analysis_link(runs):
    """The folder of `python -m analysis` of these runs at the steps they are compared at (its default, named by
    them), or None: an analysis of other steps or other run directories is not theirs."""
    folder = os.path.join(
        get_base_dir(), "reports", "analysis_" + folder_name([(os.path.basename(r["dir"]), run_step(r)) for r in runs])
    )
    m = read_manifest(folder)
    want = [{"dir": os.path.realpath(r["dir"]), "step": run_step(r)} for r in runs]
    ok = m is not None and m["tool"] == "analysis" and isinstance(m["inputs"], dict) and m["inputs"].get("runs") == want
    return folder if ok and os.path.isfile(os.path.join(folder, "analysis.md")) else None


def compare(run_args, out_dir=None, beta=0.95, force=False, mixed_precision=False):
    """report.md, figures and inputs.json of the runs against the first one, in out_dir (default: named after
    the runs and their steps, never replacing a report of other inputs there); the report's path. A folder that
    holds anything compare did not write is refused unless force (nanochat/run_dir.py claim_folder)."""
    if not 0 <= beta < 1:
        raise UserError(f"--ema must be in [0, 1), got {beta}")
    loaded = [load_run(a) for a in run_args]
    check_distinct(loaded)
    check_precision(loaded, mixed_precision)
    runs = distinct_names(loaded)
    inputs = {**report_inputs([r["dir"] for r in runs]), "ema": beta}
    if out_dir is None:  # named after the runs and steps only: it must not replace a report of other inputs
        out_dir = default_out_dir(runs)
        check_report_folder(out_dir, inputs)
    aside = claim_folder(out_dir, TOOL, inputs, force)
    pairs = [pair_stats(runs[0], r) for r in runs[1:]]  # before any output: refused pairs write nothing
    with staging(out_dir) as tmp:  # made whole, then moved in: a report cut short replaces nothing
        report = write_report(runs, pairs, beta, tmp, out_dir)
        publish(tmp, out_dir, TOOL, inputs, aside)
    warnings = [f"warning: {line}" for ps in pairs for line in difference_lines(ps)]
    versions = [f"note: {versions_note(runs)}"] if versions_note(runs) else []
    for line in (
        warnings + [v for ps in pairs for v in ps["verdicts"]] + [n for r in runs for n in r["read_notes"]] + versions
    ):
        print(line)
    path = os.path.join(out_dir, "report.md")
    print(f"\nreport with figures: {path}")
    return path


def write_report(runs, pairs, beta, tmp, out_dir):
    """report.md and its figures into tmp (links relative to out_dir, where they go); prints the summary table."""
    figures = make_figures(runs, tmp, beta, pairs)
    title = " vs ".join(f"`{r['name']}`" for r in runs)
    parts = [
        f"# {title}",
        "\n".join(f"- `{r['name']}` ({r['config'].get('arch', '?')}): {r['dir']}" for r in runs),
        summary_section(runs, beta),
        measured_section(runs, pairs),
        config_section(runs),
        core_section(runs),
    ]
    if pairs:
        parts.append(significance_section(pairs))
        if "core_deltas.png" in figures:
            parts[-1] += f"\n![{figures['core_deltas.png']}](core_deltas.png)\n"
    if several_steps(runs):
        parts.append(steps_section(runs, figures))
    curves = [
        f"![{cap}]({name})"
        for name, cap in figures.items()
        if not name.startswith(("gate_", "core_deltas", "mod_", "eval_vs_step", "step_time"))
    ]
    parts.append("## Training curves\n\n" + "\n\n".join(curves))
    gates = [f"![{cap}]({name})" for name, cap in figures.items() if name.startswith("gate_")]
    if gates:
        parts.append("## NAG gate telemetry\n\n" + "\n\n".join(gates))
    if mod_curves(runs):
        parts.append(mod_section(runs, figures))
    if step_time_section(runs, figures):
        parts.append(step_time_section(runs, figures))
    analysis = analysis_link(runs)
    if analysis:  # written by `python -m analysis` for the same runs at the same steps
        rel = os.path.relpath(os.path.join(analysis, "analysis.md"), out_dir)
        parts.append(f"## Residual geometry, attention sinks, confidence\n\n[{rel}]({rel}) (`python -m analysis`)")
    notes = notes_section(runs, figures)
    if notes:
        parts.append(notes)
    report = os.path.join(tmp, "report.md")
    atomic_write_bytes(report, ("\n\n".join(p.rstrip("\n") for p in parts) + "\n").encode())
    # the side-by-side summary (steps, tokens, FLOPs, loss, bpb, CORE), what differs, the verdicts,
    # then where the rest is
    print(parts[2])
    return report
