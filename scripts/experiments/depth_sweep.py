"""
A FLOP-matched depth sweep of several arms against GPT: does an arm's advantage grow with depth?

The paper's depth claim (its Fig. 2: NAG's loss advantage over the baseline grows as the same parameter
budget is spent on more, narrower layers) as a FLOP-matched sweep. At each depth every arm (--archs: the plain GPT
and any other arch of nag/archs.py, by default NAG) trains on one FLOP budget and one data order; the width is
chosen so that the blocks hold about as many parameters at every depth as at the reference shape. Each run's val
bpb is measured with base_eval; each arm's bpb and its gap to GPT are tabulated and plotted against depth, the gap
with a 95% interval: from the paired val batches with one seed, and with --seeds from the runs of every seed,
paired by seed, over training and evaluation noise (docs/failures.md §5).

    python -m scripts.experiments.depth_sweep --scale cpu --dry-run          # the CPU plan: widths, parameters, steps
    python -m scripts.experiments.depth_sweep --scale cpu                    # 3 depths x 2 archs on a CPU, ~16 minutes
    python -m scripts.experiments.depth_sweep --scale published --dry-run    # the published-size plan with GPU hours
    python -m scripts.experiments.depth_sweep --scale published --dry-run --archs gpt,nag,gpt-recipe   # a third arm
    python -m scripts.experiments.depth_sweep --scale published --dry-run --lr-sweep   # + each arm's LR grid: cost
    python -m scripts.experiments.depth_sweep --scale published --gpus 8     # one speedrun.sh per depth   (GPU)

--seeds 1,2,3 trains every arm once per seed (sweep-<arch>-d<depth>-s<seed>; at the published scale speedrun.sh
--seeds), each seed's runs on one init seed and data order (nanochat.common.seed_flags); the table then gives
each arm's mean over the seeds. A rerun reuses finished runs and evaluations and resumes an interrupted run from
its newest checkpoint. A run that fails is named at the end (exit status 1); the other runs, seeds and depths go
on. --base-dir (default $NANOCHAT_BASE_DIR) is taken from the directory the command runs in, as in speedrun.sh.
--lr-sweep first trains every arm at --lr-grid multiples of the preset's matrix LR at one depth, then the sweep
with each arm at its own best rate (runs at another multiple than 1 named -lr<multiple>).
Writes $NANOCHAT_BASE_DIR/reports/depth_sweep-<scale>/: depth_sweep.md, depth_sweep.json, depth_gap.png, and on a
CPU arm_geometry.png (analysis/arms.py: every arm's residual norm and rotation by layer at the deepest depth).
"""

import argparse
import contextlib
import math
import os
import subprocess
import sys
import traceback

import torch

from nanochat import checkpoint_manager as ckpt
from nanochat.common import (
    UserError,
    exit_on_user_error,
    get_base_dir,
    ensure_writable_dir,
    atomic_write_json,
    base_dir_path,
    parse_checked,
    parse_seeds,
    positive,
    positive_int,
    seed_flags,
)
from nanochat import stats
from nanochat.gpt import GPT
from nanochat.plan import PLANNED_MFU, model_config_from_args, planned_seconds
from nanochat.run_dir import CONFIG, read_config, read_eval, run_path
from nanochat.tokenizer import has_tokenizer
from nag import train_flags
from nag.archs import ARCHS, plan_for
from nag.model import NAGGPT
from nag.presets import get_preset
from scripts import base_eval, base_train
from scripts.experiments import prepare_cpu_data
from analysis.compare.groups import bpb_inputs, group_mean_ci

BASELINE = GPT.arch  # the plain GPT: every arm's gap is against it, and the widths are fitted to its blocks
DEFAULT_ARCHS = ",".join((BASELINE, NAGGPT.arch))  # --archs' default: the paper's pair
# Each scale: a preset, the reference shape whose block parameters every depth matches, the depths and the
# per-run FLOP budget. CPU: the demo model of runcpu.sh (4 x 256) at half, once and twice its depth: six
# runs of about 2 minutes each on two cores (docs/failures.md §5).
# Published: the walkthrough's 64 x 640 pair, and the depths at which the paper's width-to-depth ratios
# 80 / 60 / 40 / 30 / 20 give that block size (16 x 1280 ... 40 x 768), so the pair itself is the ratio-10 end.
SCALES = {
    "cpu": {"preset": "demo", "reference": (4, 256), "depths": [2, 4, 8], "flops": 1e13, "head_dim": 64},
    "published": {
        "preset": "published",
        "reference": (64, 640),
        "depths": [16, 20, 25, 32, 40, 64],
        "flops": 3e19,
        "head_dim": 128,
    },
}
GPUS = 8  # --gpus of the published scale: one 8-GPU node per run
MAX_PARAM_MISMATCH = 0.15  # tested: every depth's blocks within 15% of the reference's
PLAN_KEYS = ("num_params", "flops_per_token", "num_iterations", "total_tokens", "total_flops")


def parse_archs(text):
    """--archs: archs of nag/archs.py, the baseline among them and one other at least; the baseline first, the
    others in the order given."""
    archs = [a for a in text.split(",") if a]
    bad = [a for a in archs if a not in ARCHS]
    if bad:
        raise UserError(f"unknown arch {bad[0]!r} in --archs {text} (expected some of: {', '.join(ARCHS)})")
    if BASELINE not in archs or len(archs) < 2 or len(set(archs)) != len(archs):
        raise UserError(
            f"--archs takes {BASELINE} (every gap is against it) and at least one other arch, each once; got {text!r}"
        )
    return [BASELINE] + [a for a in archs if a != BASELINE]


def block_params(model):
    """Matmul parameters inside the blocks: what depth and width trade (embedding and lm_head excluded)."""
    return model.num_scaling_params() - model.lm_head.weight.numel()


def train_argv(scale, arch, depth, dim, flops, run, seed=None, lr=None):
    """base_train's flags of one run; a seed's flags (seed_flags) give every arm of that seed one init and data
    order; lr: a multiple of the preset's matrix LR (--lr-sweep; none or 1: the preset's own, no flag)."""
    s = SCALES[scale]
    lr_flags = [] if lr in (None, 1) else ["--matrix-lr", f"{lr * preset_matrix_lr(scale):.6g}"]
    return [
        "--preset",
        s["preset"],
        "--arch",
        arch,
        "--depth",
        str(depth),
        "--model-dim",
        str(dim),
        "--head-dim",
        str(s["head_dim"]),
        "--target-flops",
        f"{flops:g}",
        "--save-every",
        "-1",
        *seed_flags(seed),
        *lr_flags,
        "--run",
        run,
        "--resume",
        "latest",
    ]


def preset_matrix_lr(scale):
    """The matrix (Muon) LR of the scale's preset, before base_train's batch scaling: what --lr-grid multiplies."""
    return train_flags.parse_args(["--preset", SCALES[scale]["preset"]]).matrix_lr


def baseline_block_params(scale, depth, dim, vocab):
    config = model_config_from_args(train_flags.parse_args(train_argv(scale, BASELINE, depth, dim, 1, "x")), vocab)
    with torch.device("meta"):
        return block_params(GPT(config))


def width_for(scale, depth, target, vocab):
    """The multiple of the head dim whose blocks at this depth come closest to `target` parameters (in ratio)."""
    head = SCALES[scale]["head_dim"]
    guess = math.sqrt(target / (12 * depth))  # a block holds ~12·d² matmul parameters (4d² attention, 8d² MLP)
    best = None
    for k in range(max(1, int(guess // head) - 1), int(guess // head) + 3):
        p = baseline_block_params(scale, depth, k * head, vocab)
        err = abs(math.log(p / target))
        if best is None or err < best[0]:
            best = (err, k * head, p)
    return best[1], best[2]


def plan_sweep(scale, depths, flops, vocab, nproc, seeds=None, archs=None):
    """One row per depth: width, aspect ratio, block parameters (GPT's) and every arm's plan record (the same for
    every seed: a seed changes the init and data order, not the plan)."""
    archs = archs or parse_archs(DEFAULT_ARCHS)
    ref_depth, ref_dim = SCALES[scale]["reference"]
    target = baseline_block_params(scale, ref_depth, ref_dim, vocab)
    rows = []
    for depth in depths:
        dim, params = width_for(scale, depth, target, vocab)
        row = {
            "depth": depth,
            "dim": dim,
            "aspect_ratio": dim / depth,
            "block_params": params,
            "block_params_vs_reference": params / target,
            "runs": {},
        }
        for arch in archs:
            args = train_flags.parse_args(train_argv(scale, arch, depth, dim, flops, "x"))
            rec = plan_for(args, vocab, nproc).record(args)
            row["runs"][arch] = {k: rec[k] for k in PLAN_KEYS}
        rows.append(row)
    return {
        "scale": scale,
        "archs": archs,
        "reference": {"depth": ref_depth, "dim": ref_dim, "block_params": target},
        "flops_per_run": flops,
        "nproc": nproc,
        "seeds": seeds,
        "depths": rows,
    }


def hours(flops, gpus):
    return planned_seconds(flops, gpus) / 3600


def plan_table(plan):
    published = plan["scale"] == "published"
    lines = [
        "| depth | dim | width/depth | block params (vs ref) | arch | params | FLOPs/token | steps | tokens | "
        "FLOPs |" + (" est. hours |" if published else ""),
        "|---:|---:|---:|---|---|---:|---:|---:|---:|---:|" + ("---:|" if published else ""),
    ]
    for row in plan["depths"]:
        for arch, r in row["runs"].items():
            cells = [
                row["depth"],
                row["dim"],
                f"{row['aspect_ratio']:.0f}",
                f"{row['block_params']:,} ({row['block_params_vs_reference']:.2f}x)",
                arch,
                f"{r['num_params']:,}",
                f"{r['flops_per_token']:,}",
                f"{r['num_iterations']:,}",
                f"{r['total_tokens']:,}",
                f"{r['total_flops']:.3g}",
            ]
            if published:
                cells.append(f"{hours(r['total_flops'], plan['nproc']):.1f}")
            lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    seeds, archs = plan.get("seeds") or [None], plan["archs"]
    arm_flops = {a: len(seeds) * sum(row["runs"][a]["total_flops"] for row in plan["depths"]) for a in archs}
    total = sum(arm_flops.values())
    runs = len(seeds) * len(plan["depths"]) * len(archs)
    each = (
        f" ({len(plan['depths'])} depths × {len(archs)} archs × seeds {seeds_text(seeds)})" if plan.get("seeds") else ""
    )
    foot = f"\n{runs} runs{each}, {total:.3g} FLOPs in all"
    if published:
        n = plan["nproc"]
        foot += f", about {hours(total, n):.0f} hours on {n} GPUs at {PLANNED_MFU:.0%} MFU (evaluation not included)"
        arms = ", ".join(f"{a} {hours(f, n) * n:,.0f}" for a, f in arm_flops.items())
        foot += f"\nGPU hours per arm (every depth and seed): {arms}; all arms {hours(total, n) * n:,.0f}"
    return "\n".join(lines) + foot


# ---------------------------------------------------------------------------
# running the sweep


def seeds_text(seeds):
    return ",".join(map(str, seeds)) if seeds and seeds != [None] else "default"


def run_name(scale, arch, depth, seed=None, lr=None):
    """sweep-<arch>-d<depth>[-s<seed>] on a CPU; at the published scale speedrun.sh's
    <arch>-published-d<depth>[-s<seed>]. At lr × the preset's matrix LR (--lr-sweep), -lr<lr> after the depth: a
    run is named by its settings, so the grid's run at ×1 is the shared-rate run and an arm's tuned run at the grid's
    depth is its grid run (each is trained once)."""
    tag = depth_tag(depth, lr)
    name = f"{arch}-{SCALES[scale]['preset']}-{tag}" if scale == "published" else f"sweep-{arch}-{tag}"
    return name + (f"-s{seed}" if seed is not None else "")


def depth_tag(depth, lr=None):
    """d<depth>, and -lr<multiple> off the preset's matrix LR (speedrun.sh's --tag at the published scale)."""
    return f"d{depth}" + ("" if lr in (None, 1) else f"-lr{lr:g}")


def speedrun_cmd(row, flops, extra, seeds, archs, lr=None):
    """The speedrun.sh command of every arm (with --seeds, of every seed) at one depth, tagged d<depth> (at lr × the
    matrix LR, d<depth>-lr<lr>). speedrun.sh trains the sweep's default arms, its own default pair, without --arch."""
    s = SCALES["published"]
    arms = [] if archs == parse_archs(DEFAULT_ARCHS) else ["--arch", ",".join(archs)]
    lr_flags = [] if lr in (None, 1) else ["--matrix-lr", f"{lr * preset_matrix_lr('published'):.6g}"]
    return [
        "bash",
        "speedrun.sh",
        "--preset",
        s["preset"],
        *arms,
        "--tag",
        depth_tag(row["depth"], lr),
        "--flops",
        f"{flops:g}",
        *(["--seeds", seeds_text(seeds)] if seeds else []),
        *extra,
        "--",
        "--depth",
        str(row["depth"]),
        "--model-dim",
        str(row["dim"]),
        "--head-dim",
        str(s["head_dim"]),
        *lr_flags,
    ]


def commands(plan, extra, rows=None, lr=None):
    """What the sweep runs: base_train per run on a CPU, speedrun.sh per depth at the published scale (of `rows`,
    default every depth; lr: every arm at that multiple of the matrix LR, as --lr-sweep's grid)."""
    flops, seeds, archs = plan["flops_per_run"], plan.get("seeds"), plan["archs"]
    rows = plan["depths"] if rows is None else rows
    if plan["scale"] == "published":
        return [
            " ".join(speedrun_cmd(row, flops, extra, seeds, archs, lr))
            + "   # runs "
            + " ".join(
                run_name("published", arch, row["depth"], seed, lr) for seed in seeds or [None] for arch in archs
            )
            for row in rows
        ]
    return [
        "python -m scripts.base_train "
        + " ".join(
            train_argv(
                "cpu", arch, row["depth"], row["dim"], flops, run_name("cpu", arch, row["depth"], seed, lr), seed, lr
            )
        )
        for row in rows
        for seed in seeds or [None]
        for arch in archs
    ]


def has_bpb(run_dir, step):
    ev = read_eval(run_dir)
    return ev is not None and ev.get("step") == step and ev.get("val_batches") is not None


def check_reusable(row, base, seed, archs, lr=None):
    """A run of this name from a sweep with other --flops or widths is never mixed in: one line, before any training."""
    for arch in archs:
        run_dir = run_path(run_name("cpu", arch, row["depth"], seed, lr), base)
        steps = row["runs"][arch]["num_iterations"]
        if os.path.exists(os.path.join(run_dir, CONFIG)):  # a run that got as far as its config
            old = read_config(run_dir)
            width = old.get("model_config", {}).get("n_embd")
            if (old.get("num_iterations"), width) != (steps, row["dim"]):
                raise UserError(
                    f"{run_dir} holds a run of other settings ({old.get('num_iterations')} steps at width "
                    f"{width}, this sweep plans {steps} at {row['dim']}); move it away to rerun this depth"
                )


def run_cpu(row, flops, base, archs, seed=None, lrs=None):
    """Train (or resume) and evaluate every arm at one depth and seed; the logs go to runs/<run>.log. A run that
    fails is reported on one line (its traceback in its log) and the next goes on; returns the names of those.
    lrs: {arch: multiple of the preset's matrix LR} (--lr-sweep), else the preset's for all."""
    failed = []
    for arch in archs:
        lr = (lrs or {}).get(arch)
        run = run_name("cpu", arch, row["depth"], seed, lr)
        run_dir = run_path(run, base)
        steps = row["runs"][arch]["num_iterations"]
        log_path = run_dir + ".log"
        os.makedirs(os.path.dirname(log_path), exist_ok=True)
        done = os.path.isdir(run_dir) and ckpt.is_complete(run_dir, steps)
        what = f"depth {row['depth']} {arch}" + (f" seed {seed}" if seed is not None else "")
        what += "" if lr in (None, 1) else f" at {lr:g}x matrix LR"
        if not (done and has_bpb(run_dir, steps)):
            print(
                f"{what}: {'evaluating' if done else f'training {steps} steps'} (log: {log_path})",
                file=sys.stderr,
                flush=True,
            )
        with open(log_path, "a") as log, contextlib.redirect_stdout(log):
            try:
                if not done:
                    base_train.train(
                        train_flags.parse_args(train_argv("cpu", arch, row["depth"], row["dim"], flops, run, seed, lr))
                    )
                if not has_bpb(run_dir, steps):
                    preset_eval = get_preset(SCALES["cpu"]["preset"])["eval"]  # the demo's 65,536 tokens, as runcpu.sh
                    eval_args = ["--run", run, "--eval", "bpb", *preset_eval]
                    base_eval.evaluate(base_eval.build_parser().parse_args(eval_args))
            except Exception as e:  # not KeyboardInterrupt: Ctrl-C stops the sweep
                traceback.print_exc(file=log)
                failed.append(run)
                first = str(e).splitlines()[0] if str(e) else type(e).__name__
                print(f"{what}: failed: {first} (log: {log_path})", file=sys.stderr, flush=True)
    return failed


def run_published(row, flops, extra, seeds, archs, lr=None):
    """One speedrun.sh at this depth, for every arm and seed (it trains and evaluates CORE + bpb, and reports the
    GPT / NAG pair); whether it succeeded (speedrun.sh itself goes on past a failed run and names it)."""
    cmd = speedrun_cmd(row, flops, extra, seeds, archs, lr)
    print(" ".join(cmd), file=sys.stderr, flush=True)
    return subprocess.run(cmd).returncode == 0


def results(plan, base, lrs=None):
    """Per depth: each arm's val bpb and its gap to GPT with a 95% interval, over the seeds whose every arm is
    evaluated. One seed: the runs' val bpb and each gap's interval from the val batches it shares with GPT's run
    (evaluation noise). Several: each arm's mean over the seeds and the gap of the means, its interval from the
    group statistics of scripts.compare --a/--b (stats.group_delta, paired by seed: training and evaluation noise).
    lrs: each arm's runs at its own multiple of the matrix LR (--lr-sweep)."""
    archs, out, lrs = plan["archs"], [], lrs or {}
    for row in plan["depths"]:
        evaluated = {}
        for seed in plan.get("seeds") or [None]:
            evs = {
                arch: read_eval(run_path(run_name(plan["scale"], arch, row["depth"], seed, lrs.get(arch)), base))
                for arch in archs
            }
            if all(evs.values()):
                evaluated[seed] = evs
        res = {"depth": row["depth"], "dim": row["dim"], "aspect_ratio": row["aspect_ratio"], "seeds": list(evaluated)}
        if len(evaluated) == 1:
            res.update(one_seed_gaps(archs, next(iter(evaluated.values()))))
        elif evaluated:
            res.update(seed_gaps(row, plan["scale"], archs, evaluated, lrs))
        out.append(res)
    return out


def one_seed_gaps(archs, evs):
    """One seed at one depth: every run's val bpb, and each arm's gap to GPT resampling their shared val batches."""
    base = evs[archs[0]]["val_batches"]
    res = {"bpb": {}, "gaps": {}, "interval": "val batches"}
    for arch in archs[1:]:
        other = evs[arch]["val_batches"]
        r = stats.bpb_delta_interval(base["nats"], other["nats"], base["bytes"], seed=0)
        res["bpb"][archs[0]], res["bpb"][arch] = r["bpb_a"], r["bpb_b"]
        res["gaps"][arch] = {"gap": r["delta"], "ci": r["ci"]}
        res["batches"] = r["batches"]
    res["runs"] = {arch: [res["bpb"][arch]] for arch in archs}
    return res


def seed_gaps(row, scale, archs, evaluated, lrs=None):
    """Several seeds at one depth: the group comparison of each arm's runs with GPT's (as compare --a/--b computes
    it). One bootstrap over the shared val batches serves every arm: a resample depends on the batches alone."""
    k = len(evaluated)
    runs = [
        {"name": run_name(scale, arch, row["depth"], seed, (lrs or {}).get(arch)), "eval": evs[arch]}
        for arch in archs
        for seed, evs in evaluated.items()
    ]
    nats, nbytes = bpb_inputs(runs)  # one line if a run lacks per-batch losses or was evaluated on other val tokens
    values, reps = stats.bpb_replicates(nats, nbytes, seed=0)
    arm = {arch: slice(i * k, (i + 1) * k) for i, arch in enumerate(archs)}
    base = arm[archs[0]]
    gaps = {}
    for arch in archs[1:]:
        r = stats.group_delta(values[base], values[arm[arch]], reps[:, base], reps[:, arm[arch]], paired=True)
        gaps[arch] = {"gap": r["delta"], "ci": r["ci"]}
    return {
        "bpb": {a: float(values[s].mean()) for a, s in arm.items()},
        "gaps": gaps,
        "batches": int(nbytes.size),
        "interval": "seeds and val batches, paired by seed",
        "runs": {a: values[s].tolist() for a, s in arm.items()},
        "mean_ci": {a: group_mean_ci(values[s], reps[:, s]) for a, s in arm.items()},
    }


def label(arch):
    return arch.upper()


def gap_label(arch):
    return f"{label(arch)} - {label(BASELINE)}"


def results_table(rows, archs):
    others = archs[1:]
    lines = [
        "| depth | dim | width/depth | seeds | "
        + " | ".join(f"{label(a)} val bpb" for a in archs)
        + " | "
        + " | ".join(f"{gap_label(a)} | 95% interval" for a in others)
        + " |",
        "|---:|---:|---:|---|" + "---:|" * len(archs) + "---:|---|" * len(others),
    ]
    for r in rows:
        head = f"| {r['depth']} | {r['dim']} | {r['aspect_ratio']:.0f} |"
        if "gaps" in r:
            bpbs = " | ".join(f"{r['bpb'][a]:.4f}" for a in archs)
            gaps = " | ".join(
                f"{g['gap']:+.4f} | {g['ci'][0]:+.4f} … {g['ci'][1]:+.4f}" for g in (r["gaps"][a] for a in others)
            )
            lines.append(f"{head} {seeds_text(r['seeds'])} | {bpbs} | {gaps} |")
        else:
            lines.append(f"{head} - |" + " - |" * len(archs) + " - | not evaluated |" * len(others))
    return "\n".join(lines)


INTERVALS = (
    "With one seed per depth the values are that seed's runs and each gap's 95% interval resamples the val "
    "batches the arm's run and GPT's share (evaluation noise only). With several, the values are means over "
    "the seeds whose every arm is evaluated (column seeds) and the interval of each mean gap holds training "
    "noise (seeds) and evaluation noise, paired by seed: stats.group_delta, as "
    "`python -m scripts.compare --a ... --b ...` (docs/comparisons.md)."
)


def plot(rows, archs, path):
    """Left: each arm's gap to GPT against depth with its interval (faint: each seed's); right: every arm's val bpb
    against depth (faint: each run; with seeds, the mean's interval). An arm keeps its colour in both."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if "gaps" in r]
    depths = [r["depth"] for r in rows]
    seeds = any(len(r["seeds"]) > 1 for r in rows)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    base = archs[0]
    for i, arch in enumerate(archs[1:], 1):
        dodge = 1.03 ** (i - len(archs) / 2)  # arms side by side on the log axis, their error bars apart
        x = [d * dodge for d in depths]
        gaps = [r["gaps"][arch] for r in rows]
        ax1.errorbar(
            x,
            [g["gap"] for g in gaps],
            yerr=yerr([g["gap"] for g in gaps], [g["ci"] for g in gaps]),
            marker="o",
            capsize=4,
            color=f"C{i}",
            label=gap_label(arch),
        )
        for xi, r in zip(x, rows):  # each seed's gap (one seed: the point itself)
            ax1.plot(
                [xi] * len(r["seeds"]),
                [b - a for a, b in zip(r["runs"][base], r["runs"][arch])],
                "o",
                color=f"C{i}",
                alpha=0.25,
            )
    ax1.axhline(0, color="gray", lw=0.8)
    ax1.set(
        xscale="log",
        xlabel="depth × width (block parameters held)",
        ylabel="arm - GPT val bpb (below 0: arm better)",
        title="gap to GPT (faint: each seed), 95% interval" if seeds else "gap to GPT against depth, 95% interval",
    )
    ax1.legend()
    for i, arch in enumerate(archs):
        with_ci = [r for r in rows if "mean_ci" in r]  # several seeds: the mean's interval
        ax2.plot(depths, [r["bpb"][arch] for r in rows], marker="o", color=f"C{i}", label=label(arch))
        ax2.errorbar(
            [r["depth"] for r in with_ci],
            [r["bpb"][arch] for r in with_ci],
            yerr=yerr([r["bpb"][arch] for r in with_ci], [r["mean_ci"][arch] for r in with_ci]),
            fmt="none",
            ecolor=f"C{i}",
            capsize=4,
        )
        for r in rows:
            ax2.plot([r["depth"]] * len(r["runs"][arch]), r["runs"][arch], "o", color=f"C{i}", alpha=0.25)
    ax2.set(
        xscale="log",
        xlabel="depth × width",
        ylabel="val bpb",
        title=(
            "val bpb (faint: each run; line: the mean over seeds)" if seeds else "val bpb of each run (one FLOP budget)"
        ),
    )
    ax2.legend()
    for ax in (ax1, ax2):
        ax.set_xticks(depths, [f"{r['depth']}\n×{r['dim']}" for r in rows])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def yerr(values, cis):
    """Error bar lengths below and above each value; clipped at 0: a bootstrap interval of identical differences
    can miss its centre by a rounding error."""
    return [[max(0.0, v - ci[0]) for v, ci in zip(values, cis)], [max(0.0, ci[1] - v) for v, ci in zip(values, cis)]]


# ---------------------------------------------------------------------------
# the residual stream of every arm at the deepest depth (analysis/arms.py)


def sweep_geometry(plan, base, lrs=None):
    """Residual norm and rotation by layer of every arm's run at the sweep's deepest depth (the first seed's), over
    the val tokens of the preset's analysis flags (demo: 65,536). An arm whose run is not finished is left out; one
    whose pass fails is named on one line (a by-product: the sweep's exit status is its runs').
    Returns (that depth's plan row, {arch: {"norm", "rotation", "run", "step", "tokens"}})."""
    from analysis.arms import arm_geometry
    from analysis.run import parse_args as analysis_args
    from nanochat.common import autodetect_device_type

    row = max(plan["depths"], key=lambda r: r["depth"])
    seed = (plan.get("seeds") or [None])[0]
    a = analysis_args(["run", *get_preset(SCALES[plan["scale"]]["preset"])["analysis"]])
    device = a.device_type or autodetect_device_type()
    print(f"residual geometry at depth {row['depth']}: {a.tokens:,} val tokens per arm", file=sys.stderr, flush=True)
    geometry = {}
    for arch in plan["archs"]:
        run = run_name(plan["scale"], arch, row["depth"], seed, (lrs or {}).get(arch))
        run_dir, steps = run_path(run, base), row["runs"][arch]["num_iterations"]
        if not (os.path.isdir(run_dir) and ckpt.is_complete(run_dir, steps)):
            continue
        try:
            with open(run_dir + ".log", "a") as log, contextlib.redirect_stdout(log):  # the data loader's notes
                g = arm_geometry(run_dir, a.tokens, a.device_batch_size, device, step=steps, seed=a.seed)
        except Exception as e:
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            print(f"note: residual geometry of {run} failed: {first}", file=sys.stderr, flush=True)
            continue
        geometry[arch] = {**g, "run": run}
    return row, geometry


def geometry_table(geometry, archs):
    head = "| arch | run | norm: embedding | norm: last layer | last / embedding | rotation per layer: mean (°) |"
    lines = [head + " last layer (°) |", "|---|---|---:|---:|---:|---:|---:|"]
    for arch in (a for a in archs if a in geometry):
        g = geometry[arch]
        n, r = g["norm"], g["rotation"]
        lines.append(
            f"| {label(arch)} | {g['run']} | {n[0]:.2f} | {n[-1]:.2f} | {n[-1] / n[0]:.2f} | "
            f"{sum(r) / len(r):.1f} | {r[-1]:.1f} |"
        )
    return "\n".join(lines)


def plot_geometry(row, geometry, archs, path):
    """arm_geometry.png: every arm in its colour of depth_gap.png."""
    from analysis.arms import plot_geometry as plot_arms

    tokens = next(iter(geometry.values()))["tokens"]
    title = f"Residual stream by layer at depth {row['depth']} × width {row['dim']}"
    title += f" (one run per arm, {tokens:,} val tokens)"
    ordered = {a: geometry[a] for a in archs if a in geometry}
    plot_arms(ordered, path, title, {a: f"C{i}" for i, a in enumerate(archs)}, {a: label(a) for a in archs})


GEOMETRY = (
    "Residual stream at the deepest depth (`analysis/arms.py`, the measures of docs/analysis.md at block "
    "boundaries): norm = mean ‖x‖ over the val tokens after each layer (0: the embedding), rotation = the mean "
    "angle between a block's input and its output. One run per arm (the first seed's)."
)


# ---------------------------------------------------------------------------
# --lr-sweep: each arm at its own best matrix LR

LR_GRID = "0.5,1,2"  # --lr-grid's default: multiples of the preset's matrix LR


def parse_lr_grid(text):
    try:
        grid = [float(m) for m in text.split(",") if m.strip()]
    except ValueError:
        raise UserError(f"--lr-grid takes comma-separated multiples of the preset's matrix LR, got {text!r}") from None
    if len(grid) < 2 or not all(math.isfinite(m) and m > 0 for m in grid) or len(set(grid)) != len(grid):
        raise UserError(f"--lr-grid needs at least two different positive multiples, got {text!r}")
    return sorted(grid)


def lr_plan(scale, depths, grid):
    """Where the grid runs: the scale's reference depth (its preset's own shape, the one the preset's LRs were set
    at) when the sweep has it, else the middle of the sweep's depths."""
    ref = SCALES[scale]["reference"][0]
    if ref in depths:
        depth, why = ref, "the scale's reference depth"
    else:
        depth, why = depths[len(depths) // 2], "the middle depth"
    return {"depth": depth, "depth_is": why, "grid": grid, "preset_matrix_lr": preset_matrix_lr(scale)}


def lr_row(plan):
    return next(r for r in plan["depths"] if r["depth"] == plan["lr_sweep"]["depth"])


def lr_cost(plan):
    """--lr-sweep's cost beyond the shared-rate sweep of the plan table: at the grid's depth each arm's tuned run is
    one of its grid runs, and at the other depths each arm trains once, at its own best rate."""
    lr, archs, seeds = plan["lr_sweep"], plan["archs"], plan.get("seeds") or [None]
    row, nproc = lr_row(plan), plan["nproc"]
    flops_of = lambda rows: len(seeds) * sum(r["runs"][a]["total_flops"] for r in rows for a in archs)
    new = len(lr["grid"]) - 1  # at its depth the grid's runs stand for the sweep's: one of its multiples is the best
    others = [r for r in plan["depths"] if r is not row]
    grid_runs, grid_flops = new * len(archs) * len(seeds), new * flops_of([row])
    more_runs, more_flops = len(others) * len(archs) * len(seeds), flops_of(others)

    def gpu_hours(flops):
        if plan["scale"] != "published":
            return ""
        return f", about {hours(flops, nproc):.0f} hours on {nproc} GPUs ({hours(flops, nproc) * nproc:,.0f} GPU hours)"

    return (
        f"--lr-sweep: matrix LR × {grid_text(lr['grid'])} of the preset's {lr['preset_matrix_lr']:g} at depth "
        f"{lr['depth']} ({lr['depth_is']}), every arm: {grid_runs} runs more than the sweep without --lr-sweep, "
        f"{grid_flops:.3g} FLOPs{gpu_hours(grid_flops)}\nthen every depth with each arm at its own best rate: an arm "
        f"whose best is ×1 reuses its shared-rate runs; after a shared-rate sweep, up to {more_runs} runs more, "
        f"{more_flops:.3g} FLOPs{gpu_hours(more_flops)}"
    )


def grid_text(grid):
    return ", ".join(f"{m:g}" for m in grid)


def lr_words(lr):
    return "" if lr in (None, 1) else f" at {lr:g}x matrix LR"


def run_grid(plan, flops, base, extra):
    """Every arm at every multiple of the grid, at its depth (and seeds); the names of what failed."""
    row, seeds, archs, failed = lr_row(plan), plan.get("seeds"), plan["archs"], []
    for m in plan["lr_sweep"]["grid"]:
        if plan["scale"] == "cpu":
            for seed in seeds or [None]:
                failed += run_cpu(row, flops, base, archs, seed, {a: m for a in archs})
        elif not run_published(row, flops, extra, seeds, archs, m):
            failed.append(f"speedrun.sh at depth {row['depth']}{lr_words(m)}")
    return failed


def by_rate(archs, lrs):
    """[(multiple, its arms)], in the arms' order: one speedrun.sh per depth and rate (without lrs: one, all arms)."""
    groups = {}
    for arch in archs:
        m = (lrs or {}).get(arch)
        groups.setdefault(None if m in (None, 1) else m, []).append(arch)
    return list(groups.items())


def bpb_of(ev):
    """An evaluation's val bpb: its own, or from its per-batch nats and bytes."""
    if ev.get("val_bpb") is not None:
        return ev["val_bpb"]
    vb = ev.get("val_batches") or {}
    return sum(vb["nats"]) / (math.log(2) * sum(vb["bytes"])) if vb.get("nats") else None


def grid_results(plan, base):
    """{arch: {multiple: val bpb of its grid run (with seeds, the mean over those evaluated), None if none}}."""
    lr, row, seeds, out = plan["lr_sweep"], lr_row(plan), plan.get("seeds") or [None], {}
    for arch in plan["archs"]:
        out[arch] = {}
        for m in lr["grid"]:
            runs = [run_path(run_name(plan["scale"], arch, row["depth"], s, m), base) for s in seeds]
            bpbs = [b for b in (bpb_of(ev) for ev in map(read_eval, runs) if ev) if b is not None]
            out[arch][m] = sum(bpbs) / len(bpbs) if bpbs else None
    return out


def best_rates(grid):
    """Each arm's multiple of lowest val bpb (the first of equal ones); None for an arm with no grid run evaluated
    (it stays at the preset's rate)."""
    return {
        arch: min((m for m, b in by.items() if b is not None), key=lambda m: by[m], default=None)
        for arch, by in grid.items()
    }


def lr_table(lr, grid, best):
    base_lr = lr["preset_matrix_lr"]
    lines = [
        "| arch | " + " | ".join(f"×{m:g} ({m * base_lr:.4g})" for m in lr["grid"]) + " | own best rate |",
        "|---|" + "---:|" * len(lr["grid"]) + "---|",
    ]
    for arch, by in grid.items():
        cells = [f"{b:.4f}" if b is not None else "-" for b in by.values()]
        m = best[arch]
        chosen = f"×{m:g} ({m * base_lr:.4g})" if m is not None else "none evaluated: the preset's"
        lines.append(f"| {label(arch)} | " + " | ".join(cells) + f" | {chosen} |")
    return "\n".join(lines)


def lr_report(lr, grid, best):
    """depth_sweep.json's lr_sweep: the grid, every arm's grid results and its chosen multiple and rate."""
    return {
        **lr,
        "val_bpb": {a: {f"{m:g}": b for m, b in by.items()} for a, by in grid.items()},
        "best": best,
        "matrix_lr": {a: (m if m is not None else 1) * lr["preset_matrix_lr"] for a, m in best.items()},
    }


OWN_RATE = (
    "Compared at each arm's own best rate (--lr-sweep): every arm's runs, at every depth, use the multiple of the "
    "preset's matrix LR that gave it the lowest val bpb on the grid below (run at depth {depth}, {depth_is}); "
    "runs at another multiple than ×1 are named -lr<multiple>. The other settings are the preset's."
)


def parse_depths(text):
    try:
        depths = [int(d) for d in text.split(",") if d.strip()]
    except ValueError:
        raise UserError(f"--depths takes comma-separated layer counts, got {text!r}") from None
    if len(depths) < 2 or any(d < 1 for d in depths) or len(set(depths)) != len(depths):
        raise UserError(f"--depths needs at least two different positive depths, got {text!r}")
    return sorted(depths)


def vocab_size(scale, base):
    if scale == "published":
        return get_preset("published")["vocab"]
    if has_tokenizer(base):
        from nanochat.tokenizer import get_tokenizer

        return get_tokenizer().get_vocab_size()
    return get_preset(SCALES["cpu"]["preset"])["vocab"]  # a dry run before the tokenizer exists


def build_parser():
    p = argparse.ArgumentParser(
        description="FLOP-matched arms (GPT, NAG, ...) across depths at a fixed block size",
        epilog="--scale published: further flags go to speedrun.sh (e.g. --eval-bundle DIR)",
    )
    p.add_argument("--scale", default="cpu", help="cpu or published")
    p.add_argument("--depths", default="", help="comma-separated depths (default: the scale's)")
    p.add_argument(
        "--archs",
        default=DEFAULT_ARCHS,
        help=f"comma-separated arms, {BASELINE} among them (every gap is against it); any of: {', '.join(ARCHS)}",
    )
    p.add_argument(
        "--flops", type=positive(float), default=None, help="FLOP budget of every run (default: the scale's)"
    )
    p.add_argument(
        "--gpus",
        type=positive_int,
        default=None,
        help=f"published: processes per run (default {GPUS}; the plan's hours)",
    )
    p.add_argument(
        "--seeds",
        default=None,
        help="comma-separated seeds, e.g. 1,2,3: every arm once per seed (runs named -s<seed>, on that "
        "seed's init and data order); gaps of the means",
    )
    p.add_argument(
        "--base-dir",
        default=None,
        help="data, tokenizer, runs and the report (default $NANOCHAT_BASE_DIR or ~/.cache/nanochat)",
    )
    p.add_argument(
        "--lr-sweep",
        action="store_true",
        help="first train every arm at --lr-grid multiples of the preset's matrix LR at one depth (the scale's "
        "reference depth, else the middle one), then the sweep with each arm at its own best rate",
    )
    p.add_argument(
        "--lr-grid",
        default=None,
        help=f"with --lr-sweep: comma-separated multiples of the preset's matrix LR (default {LR_GRID})",
    )
    p.add_argument("--dry-run", action="store_true", help="the plan only: nothing is trained or written")
    return p


def main(argv=None):
    args, extra = parse_checked(build_parser(), argv, known=True)
    with exit_on_user_error(
        interrupted="interrupted: finished runs and evaluations are kept; the same command "
        "resumes the sweep (an unfinished run from its newest checkpoint)"
    ):
        if args.scale not in SCALES:
            raise UserError(f"unknown --scale {args.scale!r} (expected cpu or published)")
        if args.scale == "cpu" and extra:
            raise UserError(f"unknown arguments for --scale cpu: {' '.join(extra)}")
        s = SCALES[args.scale]
        archs = parse_archs(args.archs)
        depths = parse_depths(args.depths) if args.depths else s["depths"]
        flops = args.flops if args.flops is not None else s["flops"]
        if args.gpus is not None and args.scale == "cpu":  # as base_train's notes on a flag its arch does not read
            print(
                "note: --gpus applies only with --scale published; this cpu sweep ignores it (each run trains in one "
                "process)",
                file=sys.stderr,
                flush=True,
            )
        seeds = parse_seeds(args.seeds) if args.seeds is not None else None
        if args.lr_grid is not None and not args.lr_sweep:
            raise UserError("--lr-grid goes with --lr-sweep")
        grid = parse_lr_grid(args.lr_grid or LR_GRID) if args.lr_sweep else None
        base = base_dir_path(args.base_dir)
        os.environ["NANOCHAT_BASE_DIR"] = base  # for base_train and base_eval here and speedrun.sh below
        get_base_dir()  # created here, or one line saying why it cannot be
        out_dir = os.path.join(base, "reports", f"depth_sweep-{args.scale}")
        if not args.dry_run:
            ensure_writable_dir(out_dir)
            if args.scale == "cpu":
                prepare_cpu_data(base)  # first, so that the plan has the tokenizer's own vocab
        nproc = (args.gpus or GPUS) if args.scale == "published" else 1
        plan = plan_sweep(args.scale, depths, flops, vocab_size(args.scale, base), nproc, seeds, archs)
        if grid:
            plan["lr_sweep"] = lr_plan(args.scale, depths, grid)
        print(plan_table(plan), file=sys.stderr, flush=True)
        if grid:
            print(lr_cost(plan), file=sys.stderr, flush=True)
        extra = ["--gpus", str(nproc), *extra] if args.scale == "published" else []
        if args.dry_run:
            cmds = commands(plan, extra)
            if grid:  # the tuned runs are known after the grid; the shared-rate ones stand for them
                head = [f"the grid at depth {plan['lr_sweep']['depth']}:"]
                head += [c for m in grid for c in commands(plan, extra, [lr_row(plan)], m)]
                cmds = head + ["then every depth, each arm at its own best rate (shown: ×1, the shared rate):", *cmds]
            print("\n".join(["", "commands:", *cmds, "dry run: nothing was trained or written"]), file=sys.stderr)
            return plan
        if args.scale == "cpu":
            for row in plan["depths"]:
                for seed in seeds or [None]:
                    for lr in grid or [None]:
                        check_reusable(row, base, seed, archs, lr)
        failed, lrs = [], None  # failed: named at the end, the other runs, seeds and depths go on
        if grid:
            failed += run_grid(plan, flops, base, extra)
            grid_res = grid_results(plan, base)
            lrs = best_rates(grid_res)
            chosen = ", ".join(f"{a} ×{m:g}" if m is not None else f"{a} (none evaluated)" for a, m in lrs.items())
            print(f"own best matrix LR (depth {plan['lr_sweep']['depth']}): {chosen}", file=sys.stderr, flush=True)
        for row in plan["depths"]:
            if args.scale == "cpu":
                for seed in seeds or [None]:
                    failed += run_cpu(row, flops, base, archs, seed, lrs)
            else:
                for lr, arms in by_rate(archs, lrs):
                    if not run_published(row, flops, extra, seeds, arms, lr):
                        failed.append(f"speedrun.sh at depth {row['depth']}" + lr_words(lr))
        rows = results(plan, base, lrs)
        text = results_table(rows, archs)
        plot(rows, archs, os.path.join(out_dir, "depth_gap.png"))
        report = {"plan": plan, "results": rows}
        if grid:
            report.update(compared_at="own best rate", lr_sweep=lr_report(plan["lr_sweep"], grid_res, lrs))
        geometry_md = ""
        if args.scale == "cpu":  # published runs live on GPU nodes: analysis/arms.py can measure them there
            geo_row, geometry = sweep_geometry(plan, base, lrs)
            report.update(geometry_depth=geo_row["depth"], geometry=geometry)
            if geometry:
                plot_geometry(geo_row, geometry, archs, os.path.join(out_dir, "arm_geometry.png"))
                arms = ", ".join(label(a) for a in geometry)
                geometry_md = (
                    f"\n{GEOMETRY}\n\n{geometry_table(geometry, archs)}\n\n"
                    f"![{arms}: residual norm and rotation by layer](arm_geometry.png)\n"
                )
        atomic_write_json(os.path.join(out_dir, "depth_sweep.json"), report)
        gaps = ", ".join(gap_label(a) for a in archs[1:])
        lr_md = ""
        if grid:
            lr_md = (
                f"{lr_cost(plan)}\n\n{OWN_RATE.format(**plan['lr_sweep'])}\n\n"
                f"Val bpb at depth {plan['lr_sweep']['depth']} by multiple of the matrix LR:\n\n"
                f"{lr_table(plan['lr_sweep'], grid_res, lrs)}\n\n"
            )
        with open(os.path.join(out_dir, "depth_sweep.md"), "w") as f:
            f.write(
                f"# Depth sweep ({args.scale})\n\nPlan:\n\n{plan_table(plan)}\n\n{lr_md}"
                f"Results (val bpb, base_eval{', each arm at its own best rate' if grid else ''}):\n\n"
                f"{text}\n\n{INTERVALS}\n\n![{gaps} gap against depth](depth_gap.png)\n{geometry_md}"
            )
        print(text)
        print(f"report: {os.path.join(out_dir, 'depth_sweep.md')}", file=sys.stderr)
        if failed:
            raise UserError(f"failed: {', '.join(failed)} (rerun to retry them; finished runs are reused)")
        return rows


if __name__ == "__main__":
    main()
