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
    python -m scripts.experiments.depth_sweep --scale published --gpus 8     # one speedrun.sh per depth   (GPU)

--seeds 1,2,3 trains every arm once per seed (sweep-<arch>-d<depth>-s<seed>; at the published scale speedrun.sh
--seeds), each seed's runs on one init seed and data order (nanochat.common.seed_flags); the table then gives
each arm's mean over the seeds. A rerun reuses finished runs and evaluations and resumes an interrupted run from
its newest checkpoint. A run that fails is named at the end (exit status 1); the other runs, seeds and depths go
on. --base-dir (default $NANOCHAT_BASE_DIR) is taken from the directory the command runs in, as in speedrun.sh.
Writes $NANOCHAT_BASE_DIR/reports/depth_sweep-<scale>/: depth_sweep.md, depth_sweep.json, depth_gap.png.
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
    parse_seeds,
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


def train_argv(scale, arch, depth, dim, flops, run, seed=None):
    """base_train's flags of one run; a seed's flags (seed_flags) give every arm of that seed one init and data
    order."""
    s = SCALES[scale]
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
        "--run",
        run,
        "--resume",
        "latest",
    ]


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


def run_name(scale, arch, depth, seed=None):
    """sweep-<arch>-d<depth>[-s<seed>] on a CPU; at the published scale speedrun.sh's
    <arch>-published-d<depth>[-s<seed>]."""
    name = f"{arch}-{SCALES[scale]['preset']}-d{depth}" if scale == "published" else f"sweep-{arch}-d{depth}"
    return name + (f"-s{seed}" if seed is not None else "")


def speedrun_cmd(row, flops, extra, seeds, archs):
    """The speedrun.sh command of every arm (with --seeds, of every seed) at one depth, tagged d<depth>. speedrun.sh
    trains the sweep's default arms, its own default pair, without --arch."""
    s = SCALES["published"]
    arms = [] if archs == parse_archs(DEFAULT_ARCHS) else ["--arch", ",".join(archs)]
    return [
        "bash",
        "speedrun.sh",
        "--preset",
        s["preset"],
        *arms,
        "--tag",
        f"d{row['depth']}",
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
    ]


def commands(plan, extra):
    """What the sweep runs: base_train per run on a CPU, speedrun.sh per depth at the published scale."""
    flops, seeds, archs = plan["flops_per_run"], plan.get("seeds"), plan["archs"]
    if plan["scale"] == "published":
        return [
            " ".join(speedrun_cmd(row, flops, extra, seeds, archs))
            + "   # runs "
            + " ".join(run_name("published", arch, row["depth"], seed) for seed in seeds or [None] for arch in archs)
            for row in plan["depths"]
        ]
    return [
        "python -m scripts.base_train "
        + " ".join(
            train_argv("cpu", arch, row["depth"], row["dim"], flops, run_name("cpu", arch, row["depth"], seed), seed)
        )
        for row in plan["depths"]
        for seed in seeds or [None]
        for arch in archs
    ]


def has_bpb(run_dir, step):
    ev = read_eval(run_dir)
    return ev is not None and ev.get("step") == step and ev.get("val_batches") is not None


def check_reusable(row, base, seed, archs):
    """A run of this name from a sweep with other --flops or widths is never mixed in: one line, before any training."""
    for arch in archs:
        run_dir = run_path(run_name("cpu", arch, row["depth"], seed), base)
        steps = row["runs"][arch]["num_iterations"]
        if os.path.exists(os.path.join(run_dir, CONFIG)):  # a run that got as far as its config
            old = read_config(run_dir)
            width = old.get("model_config", {}).get("n_embd")
            if (old.get("num_iterations"), width) != (steps, row["dim"]):
                raise UserError(
                    f"{run_dir} holds a run of other settings ({old.get('num_iterations')} steps at width "
                    f"{width}, this sweep plans {steps} at {row['dim']}); move it away to rerun this depth"
                )


def run_cpu(row, flops, base, archs, seed=None):
    """Train (or resume) and evaluate every arm at one depth and seed; the logs go to runs/<run>.log. A run that
    fails is reported on one line (its traceback in its log) and the next goes on; returns the names of those."""
    failed = []
    for arch in archs:
        run = run_name("cpu", arch, row["depth"], seed)
        run_dir = run_path(run, base)
        steps = row["runs"][arch]["num_iterations"]
        log_path = run_dir + ".log"
        os.makedirs(os.path.dirname(log_path), exist_ok=True)
        done = os.path.isdir(run_dir) and ckpt.is_complete(run_dir, steps)
        what = f"depth {row['depth']} {arch}" + (f" seed {seed}" if seed is not None else "")
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
                        train_flags.parse_args(train_argv("cpu", arch, row["depth"], row["dim"], flops, run, seed))
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


def run_published(row, flops, extra, seeds, archs):
    """One speedrun.sh at this depth, for every arm and seed (it trains and evaluates CORE + bpb, and reports the
    GPT / NAG pair); whether it succeeded (speedrun.sh itself goes on past a failed run and names it)."""
    cmd = speedrun_cmd(row, flops, extra, seeds, archs)
    print(" ".join(cmd), file=sys.stderr, flush=True)
    return subprocess.run(cmd).returncode == 0


def results(plan, base):
    """Per depth: each arm's val bpb and its gap to GPT with a 95% interval, over the seeds whose every arm is
    evaluated. One seed: the runs' val bpb and each gap's interval from the val batches it shares with GPT's run
    (evaluation noise). Several: each arm's mean over the seeds and the gap of the means, its interval from the
    group statistics of scripts.compare --a/--b (stats.group_delta, paired by seed: training and evaluation noise)."""
    archs, out = plan["archs"], []
    for row in plan["depths"]:
        evaluated = {}
        for seed in plan.get("seeds") or [None]:
            evs = {arch: read_eval(run_path(run_name(plan["scale"], arch, row["depth"], seed), base)) for arch in archs}
            if all(evs.values()):
                evaluated[seed] = evs
        res = {"depth": row["depth"], "dim": row["dim"], "aspect_ratio": row["aspect_ratio"], "seeds": list(evaluated)}
        if len(evaluated) == 1:
            res.update(one_seed_gaps(archs, next(iter(evaluated.values()))))
        elif evaluated:
            res.update(seed_gaps(row, plan["scale"], archs, evaluated))
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


def seed_gaps(row, scale, archs, evaluated):
    """Several seeds at one depth: the group comparison of each arm's runs with GPT's (as compare --a/--b computes
    it). One bootstrap over the shared val batches serves every arm: a resample depends on the batches alone."""
    k = len(evaluated)
    runs = [
        {"name": run_name(scale, arch, row["depth"], seed), "eval": evs[arch]}
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
    p.add_argument("--flops", type=float, default=None, help="FLOP budget of every run (default: the scale's)")
    p.add_argument("--gpus", type=int, default=8, help="published: processes per run (the plan's hours)")
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
    p.add_argument("--dry-run", action="store_true", help="the plan only: nothing is trained or written")
    return p


def main(argv=None):
    args, extra = build_parser().parse_known_args(argv)
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
        if not (math.isfinite(flops) and flops > 0):
            raise UserError(f"--flops must be a positive number (got {flops:g})")
        seeds = parse_seeds(args.seeds) if args.seeds is not None else None
        base = base_dir_path(args.base_dir)
        os.environ["NANOCHAT_BASE_DIR"] = base  # for base_train and base_eval here and speedrun.sh below
        get_base_dir()  # created here, or one line saying why it cannot be
        out_dir = os.path.join(base, "reports", f"depth_sweep-{args.scale}")
        if not args.dry_run:
            ensure_writable_dir(out_dir)
            if args.scale == "cpu":
                prepare_cpu_data(base)  # first, so that the plan has the tokenizer's own vocab
        nproc = args.gpus if args.scale == "published" else 1
        plan = plan_sweep(args.scale, depths, flops, vocab_size(args.scale, base), nproc, seeds, archs)
        print(plan_table(plan), file=sys.stderr, flush=True)
        extra = ["--gpus", str(args.gpus), *extra] if args.scale == "published" else []
        if args.dry_run:
            print(
                "\n".join(["", "commands:", *commands(plan, extra), "dry run: nothing was trained or written"]),
                file=sys.stderr,
            )
            return plan
        if args.scale == "cpu":
            for row in plan["depths"]:
                for seed in seeds or [None]:
                    check_reusable(row, base, seed, archs)
        failed = []  # named at the end: the other runs, seeds and depths go on
        for row in plan["depths"]:
            if args.scale == "cpu":
                for seed in seeds or [None]:
                    failed += run_cpu(row, flops, base, archs, seed)
            elif not run_published(row, flops, extra, seeds, archs):
                failed.append(f"speedrun.sh at depth {row['depth']}")
        rows = results(plan, base)
        text = results_table(rows, archs)
        plot(rows, archs, os.path.join(out_dir, "depth_gap.png"))
        atomic_write_json(os.path.join(out_dir, "depth_sweep.json"), {"plan": plan, "results": rows})
        gaps = ", ".join(gap_label(a) for a in archs[1:])
        with open(os.path.join(out_dir, "depth_sweep.md"), "w") as f:
            f.write(
                f"# Depth sweep ({args.scale})\n\nPlan:\n\n{plan_table(plan)}\n\nResults (val bpb, base_eval):\n\n"
                f"{text}\n\n{INTERVALS}\n\n![{gaps} gap against depth](depth_gap.png)\n"
            )
        print(text)
        print(f"report: {os.path.join(out_dir, 'depth_sweep.md')}", file=sys.stderr)
        if failed:
            raise UserError(f"failed: {', '.join(failed)} (rerun to retry them; finished runs are reused)")
        return rows


if __name__ == "__main__":
    main()
