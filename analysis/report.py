"""
analysis.md: one table comparing the runs, with the paper's and walkthrough's numbers beside them.

The reference columns are at their own scale (64 blocks × 640, 2^20-token batches, ~10B tokens; the paper's
MoE ablations for Tables III-IV), so they say what to look for, not what a toy model should hit.
"""

import math

from nag.archs import is_nag_arch

REF_GPT = "reference GPT"
REF_NAG = "reference NAG"
REF_SOURCE = (
    "Reference columns: the walkthrough's FLOP-matched pair (64 blocks × dim 640, ~10B tokens) for attention "
    "sinks and rotation; the paper (arXiv:2606.16112) Table III (norm spread, baseline only) and Table IV "
    "(weights of the first expert linear; here mlp.c_fc) and §Residual-stream norm (≈120× lower final norm "
    "at width/depth ratio 80). Reference numbers are at their own scale, not targets for a toy model."
)


def _pct(x):
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}%"


def _num(x, spec=".3f"):
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _nag(r, key, fmt):
    return fmt(r["nag"][key]) if "nag" in r else "—"


def rows():
    """(label, value of a run as text, reference GPT, reference NAG)."""
    return [
        ("tokens analysed", lambda r: f"{r['tokens']:,}", "", ""),
        ("residual updates K (blocks × 2)", lambda r: str(r["num_updates"]), "128", "128"),
        (
            "final norm, mean over tokens",
            lambda r: _num(r["norm"]["mean"][-1], ".4g"),
            "",
            "≈120× lower than GPT (paper, ratio 80)",
        ),
        ("final norm without BOS", lambda r: _num(r["norm"]["mean_without_bos"][-1], ".4g"), "", ""),
        (
            "final / embedding norm",
            lambda r: _num(r["norm"]["final_over_embedding"], ".3g"),
            "grows strongly",
            "controlled",
        ),
        (
            "total rotation Σθ (deg)",
            lambda r: _num(r["rotation"]["total_deg"], ".1f"),
            "flatter, then a large last write",
            "≈ linear in depth",
        ),
        ("last update's rotation (deg)", lambda r: _num(r["rotation"]["mean_deg"][-1], ".1f"), "≈60", ""),
        (
            "total variance, first → last state",
            lambda r: (
                f"{_num(r['spectrum']['total_variance'][0], '.3g')} → "
                f"{_num(r['spectrum']['total_variance'][-1], '.3g')}"
            ),
            "no clear trend",
            "falls with depth",
        ),
        (
            "effective rank, first → last",
            lambda r: (
                f"{_num(r['spectrum']['effective_rank'][0], '.3g')} → "
                f"{_num(r['spectrum']['effective_rank'][-1], '.3g')}"
            ),
            "rises late",
            "flat",
        ),
        (
            "participation ratio, first → last",
            lambda r: (
                f"{_num(r['spectrum']['participation_ratio'][0], '.3g')} → "
                f"{_num(r['spectrum']['participation_ratio'][-1], '.3g')}"
            ),
            "rises late",
            "flat",
        ),
        ("attention on BOS", lambda r: _pct(r["attention"]["bos_share"]), "62.5%", "46.5%"),
        ("attention on first 4 keys", lambda r: _pct(r["attention"]["first4_share"]), "65.3%", "50.9%"),
        ("attention on the diagonal", lambda r: _pct(r["attention"]["diagonal_share"]), "5.2%", "6.7%"),
        (
            "layers with > 50% on BOS",
            lambda r: f"{r['attention']['layers_over_half_bos']}/{r['n_layer']}",
            "59/64",
            "27/64",
        ),
        (
            "BOS share by depth quartile",
            lambda r: " / ".join(_pct(x) for x in r["attention"]["bos_share_by_quartile"]),
            "",
            "32.6 / 39.2 / 53.5 / 60.8%",
        ),
        ("val loss (nats/token)", lambda r: _num(r["confidence"]["loss"], ".4f"), "", ""),
        ("top-1 accuracy", lambda r: _pct(r["confidence"]["top1_accuracy"]), "", ""),
        (
            "AUROC(final norm → top-1 correct)",
            lambda r: _num(r["confidence"]["auroc_norm"]),
            "",
            "norm ranks correctness",
        ),
        ("AUROC(−entropy → top-1 correct)", lambda r: _num(r["confidence"]["auroc_neg_entropy"]), "", ""),
        ("norm spread in clusters, p10", lambda r: _num(r["cluster_norm_spread"]["p10"]), "0.723–0.809", ""),
        ("norm spread in clusters, p90", lambda r: _num(r["cluster_norm_spread"]["p90"]), "1.209–1.300", ""),
        (
            "mlp.c_fc |mean|/std",
            lambda r: _num(r["weights"]["by_kind"].get("mlp.c_fc", {}).get("mean_over_std"), ".3g"),
            "8.59e-4",
            "1.50e-4",
        ),
        (
            "mlp.c_fc max|W|/RMS",
            lambda r: _num(r["weights"]["by_kind"].get("mlp.c_fc", {}).get("max_over_rms"), ".2f"),
            "19.85",
            "13.84",
        ),
        (
            "mlp.c_fc stable rank",
            lambda r: _num(r["weights"]["by_kind"].get("mlp.c_fc", {}).get("stable_rank"), ".2f"),
            "",
            "",
        ),
        (
            "NAG: mean realised gain, first → last",
            lambda r: _nag(r, "gain_mean", lambda g: f"{g[0]:.3f} → {g[-1]:.3f}"),
            "",
            "roughly flat",
        ),
        (
            "NAG: dead (mean α·m < 0.05)",
            lambda r: _nag(r, "dead_walkthrough", lambda x: f"{x}/{r['num_updates']}"),
            "",
            "\"almost a quarter\" (broken run)",
        ),
        (
            "NAG: collapsed (mean m < 0.1)",
            lambda r: _nag(r, "dead_relative", lambda x: f"{x}/{r['num_updates']}"),
            "",
            "",
        ),
        ("NAG: preferred-direction locality", lambda r: _nag(r, "locality", lambda x: _num(x)), "", "> 0 (local band)"),
        (
            "NAG self-check: max |θ − atan g| (rad)",
            lambda r: _nag(r, "atan_check_max_abs_dev", lambda x: f"{x:.2e}"),
            "",
            "0",
        ),
    ]


def markdown(runs, figures, cmdline):
    names = list(runs)
    lines = ["# Residual geometry, attention sinks and confidence", "", f"`{cmdline}`", ""]
    header = ["measure"] + [f"{n} ({runs[n]['arch']})" for n in names] + [REF_GPT, REF_NAG]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for label, value, ref_gpt, ref_nag in rows():
        cells = [label] + [value(runs[n]) for n in names] + [ref_gpt, ref_nag]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")  # |x| inside a cell
    gpt = [n for n in names if not is_nag_arch(runs[n]["arch"])]
    nag = [n for n in names if is_nag_arch(runs[n]["arch"])]
    if gpt and nag:
        g, a = runs[gpt[0]], runs[nag[0]]
        ratio = g["norm"]["mean"][-1] / a["norm"]["mean"][-1]
        lines += ["", f"Final norm, {gpt[0]} / {nag[0]}: {ratio:.3g}× (paper: ≈120× at width/depth ratio 80)."]
    lines += ["", REF_SOURCE, "", "## Figures", ""]
    lines += [f"- [{name}]({name}): {caption}" for name, caption in figures]
    lines += ["", "Every number is in analysis.json; docs/analysis.md defines each measure.", ""]
    return "\n".join(lines)
