"""
PNG figures of analysis.json, all runs on shared axes where that makes sense.

Drawn with matplotlib, Agg backend.

Each function takes {run name: summary} and the output directory, and returns [(file name, caption)].
"""

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402


def _save(fig, out_dir, name, caption, made, legend_ax=None):
    """Write one figure; legend_ax (a single-panel line plot) also gets the shared legend and grid."""
    if legend_ax is not None:
        legend_ax.legend(fontsize=8)
        legend_ax.grid(alpha=0.3)
    for ax in fig.axes:
        if ax.images:  # heatmaps keep their own ticks
            continue
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # depth and decile axes count whole steps
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, name), dpi=110)
    plt.close(fig)
    made.append((name, caption))


def _safe(name):
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def norm_vs_depth(runs, out_dir, made):
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (name, r) in enumerate(runs.items()):
        col = f"C{i}"
        k = np.arange(len(r["norm"]["mean"]))
        pct = np.array(r["norm"]["p10_p50_p90"])
        ax.fill_between(k, pct[:, 0], pct[:, 2], color=col, alpha=0.15)
        ax.plot(k, r["norm"]["mean"], color=col, label=f"{name} ({r['arch']}), mean")
        ax.plot(k, r["norm"]["mean_without_bos"], color=col, ls="--", label=f"{name}, mean without BOS")
    ax.set_yscale("log")
    ax.set_xlabel("residual state k (0 = embedding; 2i+1 after attention i, 2i+2 after MLP i)")
    ax.set_ylabel("residual norm ‖x_k‖ (NAG: √d·e^s)")
    _save(
        fig,
        out_dir,
        "norm_depth.png",
        "Residual norm vs depth: mean, mean without BOS (dashed), p10-p90 band (paper Fig. 3a-b)",
        made,
        legend_ax=ax,
    )


def rotation(runs, out_dir, made):
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (name, r) in enumerate(runs.items()):
        cum = r["rotation"]["cumulative_deg"]
        ax.plot(np.arange(1, len(cum) + 1), cum, color=f"C{i}", marker=".", label=f"{name} ({r['arch']})")
    ax.set_xlabel("residual update k")
    ax.set_ylabel("cumulative rotation Σθ (degrees)")
    _save(
        fig,
        out_dir,
        "rotation.png",
        "Cumulative rotation of the residual direction (paper Fig. 3c)",
        made,
        legend_ax=ax,
    )


def spectrum(runs, out_dir, made):
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, key, label in zip(
        axes,
        ("total_variance", "effective_rank", "participation_ratio"),
        ("total variance", "effective rank", "participation ratio"),
    ):
        for i, (name, r) in enumerate(runs.items()):
            ax.plot(r["spectrum"][key], color=f"C{i}", marker=".", label=f"{name} ({r['arch']})")
        ax.set_title(label)
        ax.set_xlabel("residual state k")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    _save(fig, out_dir, "spectrum.png", "Covariance spectrum of the unit-RMS states (paper Fig. 4)", made)


def nag_gates(runs, out_dir, made):
    nag = {n: r for n, r in runs.items() if "nag" in r}
    if not nag:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (name, r) in enumerate(nag.items()):
        g = r["nag"]
        l = np.arange(1, len(g["alpha"]) + 1)
        ax.plot(l, g["alpha"], color=f"C{i}", ls=":", label=f"{name}: α")
        ax.plot(l, g["alpha_effective"], color=f"C{i}", ls="--", label=f"{name}: α·warm-up ({g['alpha_warmup']:.2f})")
        ax.plot(l, g["gain_mean"], color=f"C{i}", marker=".", label=f"{name}: mean realised gain α·warm-up·m")
    ax.set_xlabel("sub-layer l (odd: attention, even: MLP)")
    ax.set_ylabel("gain (tan of the rotation angle)")
    _save(
        fig,
        out_dir,
        "nag_gains.png",
        "NAG: learned α, α·warm-up and mean realised gain per sub-layer (paper Fig. 5)",
        made,
        legend_ax=ax,
    )


def preferred_directions(runs, out_dir, made):
    for name, r in runs.items():
        if "nag" not in r:
            continue
        cos = np.array(r["nag"]["preferred_cosine"])
        fig, ax = plt.subplots(figsize=(5.5, 4.5))
        im = ax.imshow(cos, cmap="viridis", origin="upper")
        fig.colorbar(im, ax=ax)
        ax.set_title(f"{name}: cosine of preferred directions (locality {r['nag']['locality']:.3f})", fontsize=9)
        ax.set_xlabel("sub-layer")
        ax.set_ylabel("sub-layer")
        _save(
            fig,
            out_dir,
            f"preferred_{_safe(name)}.png",
            f"{name}: preferred-direction cosine, sub-layer × sub-layer (paper eq. 32, Fig. 6)",
            made,
        )


def _map(ax, m, title):
    m = np.array(m)
    ax.imshow(m / max(m.max(), 1e-30), cmap="magma", vmin=0, vmax=1)
    ax.set_title(title, fontsize=8)
    ax.set_xticks([])
    ax.set_yticks([])


def attention(runs, out_dir, made):
    fig, axes = plt.subplots(1, len(runs), figsize=(4.2 * len(runs), 4.2), squeeze=False)
    for ax, (name, r) in zip(axes[0], runs.items()):
        _map(ax, r["attention"]["map_mean"], f"{name} ({r['arch']}): BOS {100 * r['attention']['bos_share']:.1f}%")
    _save(
        fig,
        out_dir,
        "attention_mean.png",
        "Layer-averaged attention over the first positions, each map / its max; key 0 = BOS at the left (paper Fig. 7)",
        made,
    )
    for name, r in runs.items():
        maps = r["attention"]["maps"]
        cols = min(8, len(maps))
        rows = -(-len(maps) // cols)
        fig, axes = plt.subplots(rows, cols, figsize=(1.8 * cols, 1.8 * rows), squeeze=False)
        for i, ax in enumerate(axes.flat):
            if i < len(maps):
                _map(ax, maps[i], f"layer {i}")
            else:
                ax.axis("off")
        _save(
            fig,
            out_dir,
            f"attention_layers_{_safe(name)}.png",
            f"{name}: attention map per layer, each / its max (paper Fig. 12)",
            made,
        )
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (name, r) in enumerate(runs.items()):
        ax.plot(
            100 * np.array(r["attention"]["bos_share_by_layer"]),
            color=f"C{i}",
            marker=".",
            label=f"{name} ({r['arch']})",
        )
    ax.axhline(50, color="gray", lw=0.8)
    ax.set_xlabel("layer")
    ax.set_ylabel("attention on BOS (%)")
    _save(fig, out_dir, "bos_share.png", "Attention share on BOS (key 0) by layer", made, legend_ax=ax)


def confidence(runs, out_dir, made):
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    deciles = np.arange(1, 11)
    for i, (name, r) in enumerate(runs.items()):
        c = r["confidence"]
        for ax, key in zip(axes, ("entropy", "loss", "top1")):
            ax.plot(
                deciles,
                c["deciles_by_norm"][key],
                color=f"C{i}",
                marker=".",
                label=f"{name}: by final norm (AUROC {c['auroc_norm']:.3f})",
            )
            if key != "entropy":
                ax.plot(
                    deciles,
                    c["deciles_by_neg_entropy"][key],
                    color=f"C{i}",
                    ls="--",
                    label=f"{name}: by −entropy (AUROC {c['auroc_neg_entropy']:.3f})",
                )
    for ax, label in zip(axes, ("output entropy (nats)", "next-token loss (nats)", "top-1 accuracy")):
        ax.set_xlabel("confidence decile (1 = lowest)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[2].legend(fontsize=7)
    _save(
        fig,
        out_dir,
        "confidence.png",
        "Confidence: tokens ranked by final norm (solid) or by "
        "−entropy (dashed), in deciles; AUROC for top-1 correctness",
        made,
    )


def make_figures(runs, out_dir):
    made = []
    for fn in (norm_vs_depth, rotation, spectrum, nag_gates, preferred_directions, attention, confidence):
        fn(runs, out_dir, made)
    return made
