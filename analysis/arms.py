"""
The residual stream of several arms on shared axes: norm and rotation by layer.

The depth sweep's arm_geometry.png: one run per arm, all of one shape (the sweep's runs at its deepest depth).
The pass is analysis/capture.py's, over a fixed set of val tokens; the numbers are those of docs/analysis.md at
block boundaries:

    norm[l]      mean over tokens of ‖x_2l‖: l = 0 is the embedding, l = i + 1 the output of block i (L + 1 values)
    rotation[i]  mean angle (degrees) between block i's input x_2i and its output x_2i+2 (L values)

analysis.json's norm.mean holds every sub-layer state (2L + 1); norm[l] is its entry 2l. Its rotation is per
sub-layer update; a block's rotation is not the sum of its two, so a small Accumulator subclass adds it.

    from analysis.arms import arm_geometry, plot_geometry
    geometry = {arch: arm_geometry(run_dir, tokens=65536) for arch, run_dir in runs.items()}
    plot_geometry(geometry, "arm_geometry.png", "depth 8 × 192")
"""

import torch

from analysis.capture import Accumulator, CaptureConfig, capture
from analysis.measures import degrees, rotation_angles


class BlockAccumulator(Accumulator):
    """The capture's accumulator, plus the rotation of each whole block: x_2i → x_2i+2."""

    def __init__(self, model, cfg, device):
        super().__init__(model, cfg, device)
        self.block_rotation = torch.zeros(model.config.n_layer, dtype=torch.float64, device=device)
        self.block_in = None

    def begin_batch(self, idx, bos):
        super().begin_batch(idx, bos)
        self.block_in = None

    def state(self, k, direction, norms):
        super().state(k, direction, norms)
        if k % 2:  # after an attention: inside a block
            return
        d = direction.reshape(-1, self.dim)
        if k > 0:
            self.block_rotation[k // 2 - 1] += rotation_angles(self.block_in, d).sum()
        self.block_in = d


def geometry_of(acc):
    """{"norm": L + 1 mean norms at block boundaries, "rotation": L mean block angles in degrees}."""
    n = acc.tokens
    return {
        "norm": [float(x) for x in (acc.sums["norm"][0::2] / n).tolist()],
        "rotation": degrees((acc.block_rotation / n).tolist()),
    }


def arm_geometry(run_dir, tokens=65536, device_batch_size=8, device="cpu", step=None, seed=0):
    """Norm and rotation by layer of one run's checkpoint (its latest, or `step`), over the first val batches
    (rounded down to whole batches of device_batch_size × sequence_len, at least one; a small split: what it holds).
    Returns {"norm", "rotation", "step", "tokens"}."""
    from nanochat.common import compute_dtype_for
    from nanochat.dataloader import data_loader
    from nanochat.loss_eval import held_batches
    from nanochat.tokenizer import get_tokenizer
    from nanochat import checkpoint_manager as ckpt
    from nag.archs import load_model

    device = torch.device(device)
    tokenizer = get_tokenizer()
    step = ckpt.latest_step(run_dir) if step is None else step
    model, meta = load_model(run_dir, step, device)
    model.set_compute_dtype(compute_dtype_for(device.type))
    if "tokens" in meta:
        model.set_tokens_seen(meta["tokens"])  # NAG: its checkpoint's α warm-up factor, as python -m analysis
    B, T = device_batch_size, model.config.sequence_len
    num_batches = held_batches(tokenizer, B, T, "val", max(1, tokens // (B * T)))
    batches = data_loader(tokenizer, B, T, "val", device=device, one_pass=True)  # as held_batches counts
    # only the means are used: the token and state samples are kept minimal
    cfg = CaptureConfig(token_sample=1, state_sample=1, seed=seed)
    acc = capture(model, batches, num_batches, tokenizer.get_bos_token_id(), cfg, accumulator=BlockAccumulator)
    return {**geometry_of(acc), "step": step, "tokens": acc.tokens}


def plot_geometry(geometry, path, title, colors=None, labels=None):
    """Left: the residual norm by layer (log scale); right: each layer's rotation; one line per arm, in the
    colours and labels given ({arch: ...}; default C0, C1, ... and the names)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    colors = colors or {a: f"C{i}" for i, a in enumerate(geometry)}
    labels = labels or {a: a for a in geometry}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for arch, g in geometry.items():
        style = {"marker": "o", "ms": 3, "color": colors[arch], "label": labels[arch]}
        ax1.plot(range(len(g["norm"])), g["norm"], **style)
        ax2.plot(range(1, len(g["rotation"]) + 1), g["rotation"], **style)
    ax1.set(
        yscale="log",
        xlabel="layer (0 = embedding; l = output of block l)",
        ylabel="mean residual norm ‖x‖",
        title="residual norm by layer",
    )
    ax2.set(
        xlabel="layer",
        ylabel="rotation of the residual by the layer (degrees)",
        title="rotation by layer (block input → output)",
    )
    ax2.set_ylim(bottom=0)
    for ax in (ax1, ax2):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # layers are whole numbers
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
