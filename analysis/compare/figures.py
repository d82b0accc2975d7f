"""
The PNG figures of a pair's report, each written atomically into the report folder with its caption.

matplotlib is imported only once a report is written, and with the Agg backend (files only, no display).
"""

import io
import os

from nanochat.common import atomic_write_bytes
from nanochat.core_eval import NUM_CORE_TASKS
from nanochat.step_timer import PHASES, LABELS
from nanochat import stats
from analysis.compare.runs import ema, loss_curve, several_steps, core_value, time_shares, mod_curves


def save_figure(fig, ax, out_dir, name, caption, figures):
    """Grid, write the PNG atomically, record its caption in figures, close."""
    ax.grid(alpha=0.3)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120, bbox_inches="tight")
    atomic_write_bytes(os.path.join(out_dir, name), buf.getvalue())
    figures[name] = caption
    import matplotlib.pyplot as plt  # imported by make_figures after choosing the Agg backend

    plt.close(fig)


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

    val_points = [
        (
            r,
            c,
            [
                (row["flops"], row["val_bpb"])
                for row in r["metrics"]
                if row.get("val_bpb") is not None and row.get("flops") is not None
            ],
        )
        for r, c in zip(runs, colors)
    ]
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
                ax.plot(
                    steps,
                    vals,
                    color=plt.cm.viridis(q / max(1, len(quartiles) - 1)),
                    linestyle=styles[k % 4],
                    label=f"{r['name']} depth quartile {q + 1}",
                )
        ax.set(
            xlabel="step", ylabel="mean realised gain |g|", title="NAG realised gain by depth quartile (1 = shallowest)"
        )
        ax.legend(fontsize=8)
        save_figure(fig, ax, out_dir, "gate_gain_by_depth.png", "NAG realised gain by depth quartile", figures)

        fig, ax = plt.subplots(figsize=(8, 5))
        for k, (r, rows) in enumerate(gated):
            g = rows[-1]["gate"]
            ax.step(
                [row["step"] for row in rows],
                [row["gate"]["dead_branches"] for row in rows],
                where="post",
                color=colors[runs.index(r)],
                label=f"{r['name']} (of {g.get('num_branches', '?')}, |g| < {g.get('dead_threshold', '?')})",
            )
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
            ax.errorbar(
                [x["delta"] for x, _ in shown], [yy for _, yy in shown], xerr=err, fmt="o", color=color, capsize=3
            )
        if bare:
            ax.plot([x["delta"] for x, _ in bare], [yy for _, yy in bare], "o", color=color, markerfacecolor="none")
        ax.plot(
            rows[-1]["delta"],
            y[-1],
            "D",
            color=color,
            markersize=9,
            markerfacecolor="none" if r.get("too_few") else color,
            label=f"{ps['b']['name']} − {ps['a']['name']}",
        )  # the aggregate stands out
    ax.axvline(0, color="black", linewidth=0.8)
    ax.set_yticks(range(len(labels)), labels[::-1])
    ax.set(
        xlabel=f"Δ centred accuracy (95% CI; hollow: fewer than {stats.MIN_UNITS} items, no interval)",
        title="CORE deltas per task against the first run",
    )
    ax.legend(fontsize=8)
    save_figure(fig, ax, out_dir, "core_deltas.png", "CORE deltas per task with 95% intervals", figures)


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
                    right.annotate(
                        f"{n}/{NUM_CORE_TASKS}" + (" interrupted" if cut else ""),
                        (step, score),
                        fontsize=7,
                        textcoords="offset points",
                        xytext=(4, 4),
                    )
    left.set(xlabel="step", ylabel="val bits per byte", title="val bpb (base_eval) per evaluated step")
    right.set(
        xlabel="step",
        ylabel="CORE (centred)",
        title=f"CORE per evaluated step (hollow: partial, tasks of {NUM_CORE_TASKS})",
    )
    for ax in (left, right):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if ax.lines:
            ax.legend(fontsize=8)
    right.grid(alpha=0.3)
    save_figure(
        fig,
        left,
        out_dir,
        "eval_vs_step.png",
        "val bpb and CORE at every evaluated step (hollow: partial CORE)",
        figures,
    )


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
    ax.set(
        ylabel="share of a logged step's time (%)",
        ylim=(0, 100),
        title="Where the step time went (mean over logged steps)",
    )
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1, 0.5))
    save_figure(
        fig, ax, out_dir, "step_time.png", "Step time breakdown: mean share of each part per logged step", figures
    )


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
    save_figure(
        fig, a, out_dir, "mod_curve.png", "MoD inference trade-off: val bpb vs skip rate and vs FLOPs executed", figures
    )
