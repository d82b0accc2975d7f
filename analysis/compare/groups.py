"""
Compare two groups of runs that differ only in their seeds (and the groups in their architecture):

    python -m scripts.compare --a gpt-s1 gpt-s2 gpt-s3 --b nag-s1 nag-s2 nag-s3

One row per run (val bpb, CORE), each group's mean and seed-to-seed standard deviation, and the difference
of the group means b - a with a 95% interval and p-value that hold both training noise (seeds) and
evaluation sampling (val batches, CORE items), paired by seed where the groups share their seeds
(nanochat/stats.py group_delta; docs/comparisons.md says how and why). Writes report.md, groups.png,
comparison.json (the numbers, machine-readable) and inputs.json into --out.
"""

import os
import io
import json

import numpy as np

from nanochat.common import UserError, get_base_dir, atomic_write_bytes, atomic_write_json
from nanochat.core_eval import NUM_CORE_TASKS
from nanochat.run_dir import load_run, claim_folder, staging, publish
from nanochat import stats
from nag.archs import NOT_SETTINGS
from analysis.compare.runs import versions_note, N_RESAMPLES, pair_differences, check_same_items
from analysis.compare.inputs import (
    TOOL,
    report_inputs,
    distinct_names,
    repeated_run,
    run_step,
    check_report_folder,
    check_precision,
)
from analysis.compare.tables import fmt, value_cell, table, p_text

# what runs of one comparison may differ in: their seeds, and what is no setting of the model or its training
SEED_ARGS = {"seed", "data_seed"}
IGNORED_ARGS = NOT_SETTINGS - {"num_iterations", "target_flops", "target_param_data_ratio"} | SEED_ARGS | {"arch"}
# the published single-pair gaps (NAG − GPT, 64 × 640 at 3e19 FLOPs): how many runs would resolve them
PUBLISHED_GAPS = {"core": 0.0148, "val_bpb": 0.0086}


def seeds(run):
    """(seed, data_seed) of a run."""
    args = run["config"].get("args") or {}
    return args.get("seed"), args.get("data_seed")


def settings(run):
    return {k: v for k, v in (run["config"].get("args") or {}).items() if k not in IGNORED_ARGS}


def flag(key):
    return f"--{key.replace('_', '-')}"


def check_distinct_runs(groups):
    """A run listed twice in a group would count as a second seed, and one in both groups be compared with itself:
    refused in one line."""
    for g in ("a", "b"):
        r = repeated_run(groups[g])
        if r is not None:
            raise UserError(
                f"group {g} lists `{r['name']}` twice ({r['dir']}): a "
                "repeated run is no second seed; give each run once"
            )
    r = repeated_run(groups["a"] + groups["b"])
    if r is not None:
        raise UserError(f"`{r['name']}` is in both groups ({r['dir']}): a run compared with itself differs by nothing")


def check_settings(groups, ignored=frozenset()):
    """Refuse runs that differ in a setting: within a group in any, across groups in those both record
    (a flag only one architecture has is that architecture's). One line naming the first difference."""
    first = groups["a"][0]
    for g, runs in groups.items():
        archs = {r["config"].get("arch") for r in runs}
        if len(archs) > 1:
            raise UserError(
                f"group {g} mixes architectures ({', '.join(sorted(map(str, archs)))}): "
                "a group holds one model, several seeds"
            )
        for r in runs[1:]:
            sa, sb = settings(runs[0]), settings(r)
            diff = next((k for k in sorted(set(sa) | set(sb)) if sa.get(k) != sb.get(k)), None)
            if diff:
                raise UserError(
                    f"`{r['name']}` differs from `{runs[0]['name']}` in {flag(diff)} ({json.dumps(sa.get(diff))} vs "
                    f"{json.dumps(sb.get(diff))}): the runs of a group may differ only in their seeds"
                )
    sa, sb = settings(first), settings(groups["b"][0])
    # every run records every flag; NAG's own flags (--nag-*) are the NAG group's business, a GPT run ignores them
    own = (
        {k for k in set(sa) | set(sb) if k.startswith("nag_")}
        if first["config"].get("arch") != groups["b"][0]["config"].get("arch")
        else set()
    )
    own |= set(ignored)
    diff = next((k for k in sorted((set(sa) & set(sb)) - own) if sa[k] != sb[k]), None)
    if diff:
        raise UserError(
            f"`{groups['b'][0]['name']}` differs from `{first['name']}` in {flag(diff)} ({json.dumps(sa[diff])} vs "
            f"{json.dumps(sb[diff])}): the groups may differ only in their architecture and seeds"
        )


def check_measured(runs):
    """Refuse runs measured with other data, tokenizer, val tokens or processes; (notes) on what was not recorded."""
    notes = []
    for r in runs[1:]:
        differ, unknown = pair_differences(runs[0], r)
        if differ:
            what = "; ".join(f"{label} ({text})" for label, text in differ.items())
            raise UserError(
                f"`{r['name']}` and `{runs[0]['name']}` differ in {what}: a group comparison needs every run "
                "trained and evaluated on the same data and val tokens"
            )
        if unknown:
            notes.append(
                f"not recorded for `{r['name']}` or `{runs[0]['name']}`: "
                f"{', '.join(unknown)}; compare cannot check that they share them"
            )
    return notes + ([versions_note(runs)] if versions_note(runs) else [])


def bpb_inputs(runs):
    """(nats runs x batches, bytes) of every run's val batches, or None where no run measured val bpb."""
    have = [r for r in runs if r["eval"].get("val_bpb") is not None]
    if not have:
        return None
    if len(have) < len(runs):
        missing = next(r for r in runs if r not in have)
        raise UserError(
            f"`{missing['name']}` has no val bpb in its eval.json, "
            f"`{have[0]['name']}` has: evaluate every run with --eval bpb"
        )
    for r in runs:  # every eval.json with val bpb has its per-batch losses (run_dir.load_run)
        vb, ref = r["eval"]["val_batches"], runs[0]["eval"]["val_batches"]
        if vb.get("bytes") != ref["bytes"]:
            raise UserError(
                f"`{r['name']}` and `{runs[0]['name']}` were evaluated on different val tokens ({len(vb['nats'])} vs "
                f"{len(ref['nats'])} batches, other byte counts): evaluate "
                "every run with the same --split-tokens and batch size"
            )
    return np.array([r["eval"]["val_batches"]["nats"] for r in runs]), np.array(runs[0]["eval"]["val_batches"]["bytes"])


def core_inputs(runs):
    """Every run's CORE records and the settings they share, or None where no run has CORE scores."""
    have = [r for r in runs if r["records"]]
    if not have:
        return None
    if len(have) < len(runs):
        missing = next(r for r in runs if r not in have)
        raise UserError(
            f"`{missing['name']}` has no CORE scores, `{have[0]['name']}` has: evaluate every run with --eval core"
        )
    for r in runs[1:]:
        check_same_items(runs[0], r)
    return [r["records"][0] for r in runs], runs[0]["records"][1]


def design(groups):
    """(paired, why): paired when both groups hold the same (seed, data_seed) pairs, once each; b is then
    put in a's order, so that run j of each group shares its seeds."""
    ka, kb = ([seeds(r) for r in groups[g]] for g in ("a", "b"))
    if len(set(ka)) == len(ka) and sorted(ka, key=str) == sorted(kb, key=str) and len(ka) > 1:
        groups["b"] = sorted(groups["b"], key=lambda r: ka.index(seeds(r)))
        return True, "paired by seed: both groups hold the same (seed, data seed) pairs"
    if len(ka) == 1 or len(kb) == 1:
        return False, "unpaired: a group of one"
    return False, "unpaired: the groups do not hold the same (seed, data seed) pairs"


def metric_stats(name, runs, values, reps, ka, paired, units):
    """Per-run values, group means, seed-to-seed standard deviations, the delta of the group means and the
    runs needed, of one metric; units: (count, name) of the evaluation units, for stats.too_few_units."""
    va, vb, ra, rb = values[:ka], values[ka:], reps[:, :ka], reps[:, ka:]
    r = stats.group_delta(va, vb, ra, rb, paired)
    r["too_few"] = stats.too_few_units(*units)
    r["runs"] = {run["name"]: float(v) for run, v in zip(runs, values)}
    sd = r["seed_sd"]
    if paired:
        sigma = sd["d"]
    elif sd["a"] is not None and sd["b"] is not None:  # pooled over both groups
        sigma = float(np.sqrt(((va.size - 1) * sd["a"] ** 2 + (vb.size - 1) * sd["b"] ** 2) / (va.size + vb.size - 2)))
    else:
        sigma = None
    r["sigma"] = sigma
    r["runs_needed"] = {
        "observed": stats.runs_needed(sigma, r["delta"], paired),
        "published": stats.runs_needed(sigma, PUBLISHED_GAPS[name], paired),
    }
    r["groups"] = {
        g: {
            "mean": float(v.mean()),
            "sd": float(v.std(ddof=1)) if v.size > 1 else None,
            "n": int(v.size),
            "ci": group_mean_ci(v, rep),
        }
        for g, v, rep in (("a", va, ra), ("b", vb, rb))
    }
    return r


def group_mean_ci(values, reps):
    """95% interval of one group's mean, as group_delta does it for a difference (seeds + evaluation)."""
    k = values.size
    var_eval = float(reps.mean(1).var(ddof=1))
    if k < 2:
        var, df = var_eval, float("inf")
    else:
        var = max(values.var(ddof=1) / k + var_eval - stats.own_variance(reps) / k**2, var_eval)
        df = k - 1
    half = stats.t_quantile(0.975, df) * float(np.sqrt(var))
    return (float(values.mean() - half), float(values.mean() + half))


def group_verdict(label, r, names):
    a, b = names
    if r["too_few"]:
        return f"{b} − {a} {label} = {r['delta']:+.4f}: {r['too_few']}"
    lo, hi = r["ci"]
    call = "distinguishable from noise" if lo > 0 or hi < 0 else "not distinguishable from noise"
    what = (
        "evaluation noise only: a group of one has no seed-to-seed variance"
        if r["eval_only"]
        else f"training seeds and evaluation sampling, {'paired by seed' if r['paired'] else 'unpaired'}"
    )
    return f"{b} − {a} {label} = {r['delta']:+.4f} (95% CI {lo:+.4f} … {hi:+.4f}, p {p_text(r['p'])}): {call} ({what})"


def group_label(runs):
    return runs[0]["name"] if len(runs) == 1 else f"{runs[0]['name']} +{len(runs) - 1}"


def groups_figure(groups, metrics, out_dir):
    """Each run as a point and each group's mean with its 95% interval, one panel per metric."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 4.5), squeeze=False)
    for ax, (name, m) in zip(axes[0], metrics.items()):
        for x, g in enumerate(("a", "b")):
            vals = [m["runs"][r["name"]] for r in groups[g]]
            jitter = np.linspace(-0.12, 0.12, len(vals)) if len(vals) > 1 else [0.0]
            ax.plot(x + np.asarray(jitter), vals, "o", color=f"C{x}", alpha=0.6, markerfacecolor="none")
            s = m["groups"][g]
            ax.errorbar(
                x + 0.3,
                s["mean"],
                yerr=[[s["mean"] - s["ci"][0]], [s["ci"][1] - s["mean"]]],
                fmt="D",
                color=f"C{x}",
                capsize=5,
            )
        ax.set_xticks([0, 1], [group_label(groups["a"]), group_label(groups["b"])])
        ax.set_xlim(-0.5, 1.6)
        ax.set(
            ylabel=m["label"] + (" (lower is better)" if name == "val_bpb" else ""),
            title=f"{m['label']}: runs (hollow), group mean (95% CI)",
        )
        ax.grid(alpha=0.3)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120, bbox_inches="tight")
    plt.close(fig)
    atomic_write_bytes(os.path.join(out_dir, "groups.png"), buf.getvalue())


def report_text(groups, metrics, paired, why, notes):
    names = [r["name"] for g in ("a", "b") for r in groups[g]]
    labels = {name: m["label"] for name, m in metrics.items()}
    rows = [
        [
            g,
            f"`{r['name']}`",
            r["config"].get("arch", "—"),
            *map(value_cell, seeds(r)),
            *[f"{metrics[m]['runs'][r['name']]:.4f}" for m in metrics],
        ]
        for g in ("a", "b")
        for r in groups[g]
    ]
    parts = [
        f"# Groups: {' '.join(f'`{n}`' for n in names[: len(groups['a'])])} (a) vs "
        f"{' '.join(f'`{n}`' for n in names[len(groups['a']) :])} (b)",
        "## Runs\n\n" + table(["group", "run", "arch", "seed", "data seed", *labels.values()], rows),
    ]
    rows = [
        [g, len(groups[g]), *[f"{m['groups'][g]['mean']:.4f} ± {fmt(m['groups'][g]['sd'])}" for m in metrics.values()]]
        for g in ("a", "b")
    ]
    parts.append(
        "## Group means (± seed-to-seed standard deviation)\n\n" + table(["group", "runs", *labels.values()], rows)
    )
    lines = [
        group_verdict(m["label"], m, (group_label(groups["a"]), group_label(groups["b"]))) for m in metrics.values()
    ]
    text = f"## Difference of the group means (b − a)\n\nDesign: {why}.\n\n" + "\n".join(f"- {s}" for s in lines)
    if any(m["eval_only"] for m in metrics.values()):
        text += (
            "\n\nWith fewer than 2 runs in a group there is no seed-to-seed variance: the interval covers evaluation "
            "noise only (which batches and items were drawn), not another seed of the same run."
        )
    parts.append(text)
    sd_name = "σ_d (of the pair differences)" if paired else "σ (pooled, of one arm)"
    rows = []
    for name, m in metrics.items():
        need = m["runs_needed"]
        rows.append(
            [
                m["label"],
                fmt(m["sigma"]),
                f"{m['delta']:+.4f}",
                fmt(need["observed"], "d"),
                f"{PUBLISHED_GAPS[name]:.4f}",
                fmt(need["published"], "d"),
            ]
        )
    power = (
        "## Runs needed\n\nRuns per arm for a two-sided 5% test to "
        "find the difference 80% of the time, normal approximation: "
        + ("n = (z₀.₉₇₅ + z₀.₈)² σ_d² / δ² pairs (paired)" if paired else "n = 2 (z₀.₉₇₅ + z₀.₈)² σ² / δ² (unpaired)")
        + ". The published gaps are the NAG − GPT differences of the published pair (64 × 640, 3e19 FLOPs), "
        "one seed each.\n\n"
        + table(["metric", sd_name, "observed δ", "runs (observed δ)", "published δ", "runs (published δ)"], rows)
    )
    if all(m["sigma"] is None for m in metrics.values()):
        power += "\n\nFewer than 2 seeds per group: no seed-to-seed standard deviation, so no run count."
    parts.append(power)
    parts.append(
        "![Each run (hollow) and each group's mean with its 95% interval](groups.png)\n\nNumbers: "
        "[comparison.json](comparison.json)"
    )
    if notes:
        parts.append("## Notes\n\n" + "\n".join(f"- {n}" for n in notes))
    return "\n\n".join(parts) + "\n"


def comparison_json(groups, metrics, paired, why):
    out = {
        "design": "paired" if paired else "unpaired",
        "why": why,
        "groups": {g: [r["name"] for r in groups[g]] for g in ("a", "b")},
        "metrics": {},
    }
    for name, m in metrics.items():
        out["metrics"][name] = {
            "label": m["label"],
            "runs": m["runs"],
            "groups": m["groups"],
            "delta": {
                "value": m["delta"],
                "ci": None if m["too_few"] else list(m["ci"]),
                "p": None if m["too_few"] else m["p"],
                "se": m["se"],
                "df": m["df"] if np.isfinite(m["df"]) else None,
                "eval_only": m["eval_only"],
                "too_few": m["too_few"] or None,
            },
            "seed_sd": m["sigma"],
            "runs_needed": m["runs_needed"],
            "published_delta": PUBLISHED_GAPS[name],
        }
    return out


def compare_groups(args_a, args_b, out_dir=None, force=False, mixed_precision=False):
    """report.md, groups.png, comparison.json and inputs.json of group b against group a, in out_dir (default:
    named after the runs and their steps, never replacing a report of other inputs there); the report's path.
    A folder that holds anything compare did not write is refused unless force (nanochat/run_dir.py claim_folder)."""
    groups = {"a": [load_run(x) for x in args_a], "b": [load_run(x) for x in args_b]}
    check_distinct_runs(groups)
    runs = distinct_names(groups["a"] + groups["b"])
    for r in runs:
        if r["eval"] is None:
            raise UserError(
                f"`{r['name']}` has no eval.json: a group comparison needs every run evaluated "
                f"(`python -m scripts.base_eval --run {r['dir']}`)"
            )
    check_precision(runs, mixed_precision)
    # what the runs trained in is check_precision's: a --fp8 that admitted no layer changed nothing
    check_settings(groups, ignored={"fp8"})
    notes = check_measured(runs)
    paired, why = design(groups)
    runs = groups["a"] + groups["b"]  # b in a's seed order when paired: every array below is in this order
    bpb, core = bpb_inputs(runs), core_inputs(runs)
    if bpb is None and core is None:
        raise UserError("no run has val bpb or CORE in its eval.json: nothing to compare")
    ka = len(groups["a"])
    # the same runs split otherwise are other inputs
    inputs = {**report_inputs([r["dir"] for r in runs]), "group_a": ka}
    if out_dir is None:
        parts = ["+".join(f"{r['name'].replace(os.sep, '_')}@{run_step(r)}" for r in groups[g]) for g in ("a", "b")]
        out_dir = os.path.join(get_base_dir(), "reports", "_vs_".join(parts))
        check_report_folder(out_dir, inputs)
    aside = claim_folder(out_dir, TOOL, inputs, force)

    metrics = {}
    if bpb is not None:
        values, reps = stats.bpb_replicates(bpb[0], bpb[1], N_RESAMPLES, seed=0)
        metrics["val_bpb"] = metric_stats("val_bpb", runs, values, reps, ka, paired, (bpb[1].size, "batches"))
        metrics["val_bpb"]["label"] = "val bpb"
    if core is not None:
        values, reps = stats.core_replicates(core[0], core[1], N_RESAMPLES, seed=0)
        T = len(core[1]["tasks"])
        full = T == NUM_CORE_TASKS and all(r["eval"].get("core_metric") is not None for r in runs)
        # the aggregate rests on all its items (as in the pairwise report): each run scored the same ones
        metrics["core"] = metric_stats("core", runs, values, reps, ka, paired, (len(core[0][0]["task"]), "items"))
        metrics["core"]["label"] = "CORE" if full else f"partial CORE ({T}/{NUM_CORE_TASKS})"

    with staging(out_dir) as tmp:  # made whole, then moved in: a report cut short replaces nothing
        groups_figure(groups, metrics, tmp)
        atomic_write_json(os.path.join(tmp, "comparison.json"), comparison_json(groups, metrics, paired, why))
        atomic_write_bytes(os.path.join(tmp, "report.md"), report_text(groups, metrics, paired, why, notes).encode())
        publish(tmp, out_dir, TOOL, inputs, aside)
    names = (group_label(groups["a"]), group_label(groups["b"]))
    for line in [f"{why}"] + [group_verdict(m["label"], m, names) for m in metrics.values()] + notes:
        print(line)
    report = os.path.join(out_dir, "report.md")
    print(f"\nreport with figures: {report}")
    return report
