"""
A FLOP-matched depth sweep of GPT / NAG pairs: does NAG's advantage grow with depth?

The paper's depth claim (its Fig. 2: NAG's loss advantage over the baseline grows as the same parameter
budget is spent on more, narrower layers) as a FLOP-matched sweep. At each depth a GPT / NAG pair trains on
one FLOP budget; the width is chosen so that the blocks hold about as many parameters at every depth as at
the reference shape. Each run's val bpb is measured with base_eval, and the NAG - GPT gap is tabulated and
plotted against depth, with a 95% interval: from the paired val batches with one seed, and with --seeds from
the runs of every seed, paired by seed, over training and evaluation noise (docs/failures.md §5).

    python -m scripts.experiments.depth_sweep --scale cpu --dry-run          # the CPU plan: widths, parameters, steps
    python -m scripts.experiments.depth_sweep --scale cpu                    # 3 depths x 2 archs on a CPU, ~16 minutes
    python -m scripts.experiments.depth_sweep --scale published --dry-run    # the published-size plan with GPU hours
    python -m scripts.experiments.depth_sweep --scale published --gpus 8     # one speedrun.sh pair per depth   (GPU)

--seeds 1,2,3 trains every pair once per seed (sweep-<arch>-d<depth>-s<seed>; at the published scale speedrun.sh
--seeds), each seed setting --seed and --data-seed; the table then gives each arch's mean over the seeds.
A rerun reuses finished runs and evaluations and resumes an interrupted run from its newest checkpoint. A run
that fails is named at the end (exit status 1); the other runs, seeds and depths go on.
--base-dir (default $NANOCHAT_BASE_DIR) is taken from the directory the command runs in, as in speedrun.sh.
Writes $NANOCHAT_BASE_DIR/reports/depth_sweep-<scale>/: depth_sweep.md, depth_sweep.json, depth_gap.png.
"""

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
import traceback

import torch

from nanochat import checkpoint_manager as ckpt
from nanochat.common import UserError, exit_on_user_error, get_base_dir, ensure_writable_dir, atomic_write_json, base_dir_path, parse_seeds
from nanochat import stats
from nanochat.gpt import GPT
from nanochat.plan import PLANNED_MFU, model_config_from_args, planned_seconds
from nag.archs import plan_for
from scripts import base_eval, base_train
from scripts.experiments import prepare_cpu_data
from analysis.compare.groups import bpb_inputs, group_mean_ci
from nag.presets import get_preset

ARCH_PAIR = ("gpt", "nag")
# Each scale: a preset, the reference shape whose block parameters every depth matches, the depths and the
# per-run FLOP budget. CPU: the demo model of runcpu.sh (4 x 256) at half, once and twice its depth: six
# runs of about 2 minutes each on two cores (docs/failures.md §5).
# Published: the walkthrough's 64 x 640 pair, and the depths at which the paper's width-to-depth ratios
# 80 / 60 / 40 / 30 / 20 give that block size (16 x 1280 ... 40 x 768), so the pair itself is the ratio-10 end.
SCALES = {
    "cpu": {"preset": "demo", "reference": (4, 256), "depths": [2, 4, 8], "flops": 1e13, "head_dim": 64},
    "published": {"preset": "published", "reference": (64, 640), "depths": [16, 20, 25, 32, 40, 64], "flops": 3e19,
                  "head_dim": 128},
}
MAX_PARAM_MISMATCH = 0.15  # tested: every depth's blocks within 15% of the reference's


def block_params(model):
    """Matmul parameters inside the blocks: what depth and width trade (embedding and lm_head excluded)."""
    return model.num_scaling_params() - model.lm_head.weight.numel()


def train_argv(scale, arch, depth, dim, flops, run, seed=None):
    """base_train's flags of one run; a seed sets its init and data order (the GPT and NAG runs of a seed share them)."""
    s = SCALES[scale]
    seeds = ["--seed", str(seed), "--data-seed", str(seed)] if seed is not None else []
    return ["--preset", s["preset"], "--arch", arch, "--depth", str(depth), "--model-dim", str(dim),
            "--head-dim", str(s["head_dim"]), "--target-flops", f"{flops:g}", "--save-every", "-1", *seeds,
            "--run", run, "--resume", "latest"]


def width_for(scale, depth, target, vocab):
    """The multiple of the head dim whose blocks at this depth come closest to `target` parameters (in ratio)."""
    head = SCALES[scale]["head_dim"]
    guess = math.sqrt(target / (12 * depth))  # a block holds ~12·d² matmul parameters (4d² attention, 8d² MLP)
    best = None
    for k in range(max(1, int(guess // head) - 1), int(guess // head) + 3):
        config = model_config_from_args(base_train.parse_args(train_argv(scale, "gpt", depth, k * head, 1, "x")), vocab)
        with torch.device("meta"):
            p = block_params(GPT(config))
        err = abs(math.log(p / target))
        if best is None or err < best[0]:
            best = (err, k * head, p)
    return best[1], best[2]


def plan_sweep(scale, depths, flops, vocab, nproc, seeds=None):
    """One row per depth: width, aspect ratio, block parameters (GPT) and both archs' plan records (the same for
    every seed: a seed changes the init and data order, not the plan)."""
    ref_depth, ref_dim = SCALES[scale]["reference"]
    ref_args = base_train.parse_args(train_argv(scale, "gpt", ref_depth, ref_dim, 1, "x"))
    with torch.device("meta"):
        target = block_params(GPT(model_config_from_args(ref_args, vocab)))
    rows = []
    for depth in depths:
        dim, params = width_for(scale, depth, target, vocab)
        row = {"depth": depth, "dim": dim, "aspect_ratio": dim / depth, "block_params": params,
               "block_params_vs_reference": params / target, "runs": {}}
        for arch in ARCH_PAIR:
            args = base_train.parse_args(train_argv(scale, arch, depth, dim, flops, "x"))
            rec = plan_for(args, vocab, nproc).record(args)
            row["runs"][arch] = {k: rec[k] for k in ("num_params", "flops_per_token", "num_iterations", "total_tokens", "total_flops")}
        rows.append(row)
    return {"scale": scale, "reference": {"depth": ref_depth, "dim": ref_dim, "block_params": target},
            "flops_per_run": flops, "nproc": nproc, "seeds": seeds, "depths": rows}


def hours(flops, gpus):
    return planned_seconds(flops, gpus) / 3600


def plan_table(plan):
    lines = ["| depth | dim | width/depth | block params (vs ref) | arch | params | FLOPs/token | steps | tokens | FLOPs |"
             + (" est. hours |" if plan["scale"] == "published" else ""),
             "|---:|---:|---:|---|---|---:|---:|---:|---:|---:|" + ("---:|" if plan["scale"] == "published" else "")]
    for row in plan["depths"]:
        for arch, r in row["runs"].items():
            cells = [row["depth"], row["dim"], f"{row['aspect_ratio']:.0f}", f"{row['block_params']:,} ({row['block_params_vs_reference']:.2f}x)",
                     arch, f"{r['num_params']:,}", f"{r['flops_per_token']:,}", f"{r['num_iterations']:,}", f"{r['total_tokens']:,}",
                     f"{r['total_flops']:.3g}"]
            if plan["scale"] == "published":
                cells.append(f"{hours(r['total_flops'], plan['nproc']):.1f}")
            lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    seeds = plan.get("seeds") or [None]
    total = len(seeds) * sum(r["total_flops"] for row in plan["depths"] for r in row["runs"].values())
    runs = len(seeds) * len(plan["depths"]) * len(ARCH_PAIR)
    each = f" ({len(plan['depths'])} depths × {len(ARCH_PAIR)} archs × seeds {seeds_text(seeds)})" if plan.get("seeds") else ""
    foot = f"\n{runs} runs{each}, {total:.3g} FLOPs in all"
    if plan["scale"] == "published":
        foot += f", about {hours(total, plan['nproc']):.0f} hours on {plan['nproc']} GPUs at {PLANNED_MFU:.0%} MFU (evaluation not included)"
    return "\n".join(lines) + foot


# ---------------------------------------------------------------------------
# running the sweep


def seeds_text(seeds):
    return ",".join(map(str, seeds)) if seeds and seeds != [None] else "default"


def run_name(scale, arch, depth, seed=None):
    """sweep-<arch>-d<depth>[-s<seed>] on a CPU; at the published scale speedrun.sh's <arch>-published-d<depth>[-s<seed>]."""
    name = f"{arch}-{SCALES[scale]['preset']}-d{depth}" if scale == "published" else f"sweep-{arch}-d{depth}"
    return name + (f"-s{seed}" if seed is not None else "")


def speedrun_cmd(row, flops, extra, seeds):
    """The speedrun.sh command of the pair (with --seeds, the pairs) at one depth, tagged d<depth>."""
    s = SCALES["published"]
    return ["bash", "speedrun.sh", "--preset", s["preset"], "--tag", f"d{row['depth']}", "--flops", f"{flops:g}",
            *(["--seeds", seeds_text(seeds)] if seeds else []), *extra,
            "--", "--depth", str(row["depth"]), "--model-dim", str(row["dim"]), "--head-dim", str(s["head_dim"])]


def commands(plan, extra):
    """What the sweep runs: base_train per run on a CPU, speedrun.sh per depth at the published scale."""
    flops, seeds = plan["flops_per_run"], plan.get("seeds")
    if plan["scale"] == "published":
        return [" ".join(speedrun_cmd(row, flops, extra, seeds)) + "   # runs " +
                " ".join(run_name("published", arch, row["depth"], seed) for seed in seeds or [None] for arch in ARCH_PAIR)
                for row in plan["depths"]]
    return ["python -m scripts.base_train " + " ".join(train_argv("cpu", arch, row["depth"], row["dim"], flops,
                                                                  run_name("cpu", arch, row["depth"], seed), seed))
            for row in plan["depths"] for seed in seeds or [None] for arch in ARCH_PAIR]


def has_bpb(run_dir, step):
    path = os.path.join(run_dir, "eval.json")
    if not os.path.exists(path):
        return False
    ev = json.load(open(path))
    return ev.get("step") == step and ev.get("val_batches") is not None


def check_reusable(row, base, seed):
    """A run of this name from a sweep with other --flops or widths is never mixed in: one line, before any training."""
    for arch in ARCH_PAIR:
        run_dir = os.path.join(base, "runs", run_name("cpu", arch, row["depth"], seed))
        steps = row["runs"][arch]["num_iterations"]
        cfg_path = os.path.join(run_dir, "config.json")
        if os.path.exists(cfg_path):
            old = json.load(open(cfg_path))
            if (old.get("num_iterations"), old.get("model_config", {}).get("n_embd")) != (steps, row["dim"]):
                raise UserError(f"{run_dir} holds a run of other settings ({old.get('num_iterations')} steps at width "
                                f"{old.get('model_config', {}).get('n_embd')}, this sweep plans {steps} at {row['dim']}); "
                                "move it away to rerun this depth")


def run_cpu(row, flops, base, seed=None):
    """Train (or resume) and evaluate the pair at one depth and seed; the logs go to runs/<run>.log. A run that
    fails is reported on one line (its traceback in its log) and the next goes on; returns the names of those."""
    os.makedirs(os.path.join(base, "runs"), exist_ok=True)
    failed = []
    for arch in ARCH_PAIR:
        run = run_name("cpu", arch, row["depth"], seed)
        run_dir = os.path.join(base, "runs", run)
        steps = row["runs"][arch]["num_iterations"]
        log_path = os.path.join(base, "runs", f"{run}.log")
        done = os.path.isdir(run_dir) and ckpt.is_complete(run_dir, steps)
        what = f"depth {row['depth']} {arch}" + (f" seed {seed}" if seed is not None else "")
        if not (done and has_bpb(run_dir, steps)):
            print(f"{what}: {'evaluating' if done else f'training {steps} steps'} (log: {log_path})", file=sys.stderr, flush=True)
        with open(log_path, "a") as log, contextlib.redirect_stdout(log):
            try:
                if not done:
                    base_train.train(base_train.parse_args(train_argv("cpu", arch, row["depth"], row["dim"], flops, run, seed)))
                if not has_bpb(run_dir, steps):
                    preset_eval = get_preset(SCALES["cpu"]["preset"])["eval"]  # the demo's 65,536 tokens, as runcpu.sh
                    base_eval.evaluate(base_eval.build_parser().parse_args(["--run", run, "--eval", "bpb", *preset_eval]))
            except Exception as e:  # not KeyboardInterrupt: Ctrl-C stops the sweep
                traceback.print_exc(file=log)
                failed.append(run)
                first = str(e).splitlines()[0] if str(e) else type(e).__name__
                print(f"{what}: failed: {first} (log: {log_path})", file=sys.stderr, flush=True)
    return failed


def run_published(row, flops, extra, seeds=None):
    """One speedrun.sh pair at this depth, or with seeds one pair per seed (it trains, evaluates CORE + bpb and
    writes the report); whether it succeeded (speedrun.sh itself goes on past a failed run and names it)."""
    cmd = speedrun_cmd(row, flops, extra, seeds)
    print(" ".join(cmd), file=sys.stderr, flush=True)
    return subprocess.run(cmd).returncode == 0


def read_eval(base, scale, arch, depth, seed):
    path = os.path.join(base, "runs", run_name(scale, arch, depth, seed), "eval.json")
    return json.load(open(path)) if os.path.exists(path) else None


def results(plan, base):
    """Per depth: each arch's val bpb and NAG - GPT with a 95% interval, over the seeds whose pair is evaluated.
    One seed: the pair's val bpb and the interval from its shared val batches (evaluation noise). Several: each
    arch's mean over the seeds and the gap of the means, its interval from the group statistics of
    scripts.compare --a/--b (stats.group_delta, paired by seed: training and evaluation noise)."""
    out = []
    for row in plan["depths"]:
        pairs = {}
        for seed in plan.get("seeds") or [None]:
            evs = {arch: read_eval(base, plan["scale"], arch, row["depth"], seed) for arch in ARCH_PAIR}
            if all(evs.values()):
                pairs[seed] = evs
        res = {"depth": row["depth"], "dim": row["dim"], "aspect_ratio": row["aspect_ratio"], "seeds": list(pairs)}
        if len(pairs) == 1:
            evs = next(iter(pairs.values()))
            va, vb = evs["gpt"]["val_batches"], evs["nag"]["val_batches"]
            r = stats.bpb_delta_interval(va["nats"], vb["nats"], va["bytes"], seed=0)
            res.update(gpt_bpb=r["bpb_a"], nag_bpb=r["bpb_b"], gap=r["delta"], ci=r["ci"], batches=r["batches"],
                       interval="val batches", runs={"gpt": [r["bpb_a"]], "nag": [r["bpb_b"]]})
        elif pairs:
            res.update(seed_gap(row, plan["scale"], pairs))
        out.append(res)
    return out


def seed_gap(row, scale, pairs):
    """The group comparison of the GPT and NAG runs of several seeds at one depth (as compare --a/--b computes it)."""
    runs = [{"name": run_name(scale, arch, row["depth"], seed), "eval": evs[arch]} for arch in ARCH_PAIR for seed, evs in pairs.items()]
    nats, nbytes = bpb_inputs(runs)  # one line if a run lacks per-batch losses or was evaluated on other val tokens
    values, reps = stats.bpb_replicates(nats, nbytes, seed=0)
    k = len(pairs)
    r = stats.group_delta(values[:k], values[k:], reps[:, :k], reps[:, k:], paired=True)
    return {"gpt_bpb": float(values[:k].mean()), "nag_bpb": float(values[k:].mean()), "gap": r["delta"], "ci": r["ci"],
            "batches": int(nbytes.size), "interval": "seeds and val batches, paired by seed",
            "runs": {"gpt": values[:k].tolist(), "nag": values[k:].tolist()},
            "mean_ci": {"gpt": group_mean_ci(values[:k], reps[:, :k]), "nag": group_mean_ci(values[k:], reps[:, k:])}}


def results_table(rows):
    lines = ["| depth | dim | width/depth | seeds | GPT val bpb | NAG val bpb | NAG - GPT | 95% interval |",
             "|---:|---:|---:|---|---:|---:|---:|---|"]
    for r in rows:
        head = f"| {r['depth']} | {r['dim']} | {r['aspect_ratio']:.0f} |"
        if "gap" in r:
            lines.append(f"{head} {seeds_text(r['seeds'])} | {r['gpt_bpb']:.4f} | {r['nag_bpb']:.4f} | "
                         f"{r['gap']:+.4f} | {r['ci'][0]:+.4f} … {r['ci'][1]:+.4f} |")
        else:
            lines.append(f"{head} - | - | - | - | not evaluated |")
    return "\n".join(lines)


INTERVALS = ("With one seed per depth the values are that pair's and the 95% interval resamples the val batches both runs share "
             "(evaluation noise only). With several, the values are means over the seeds whose pair is evaluated (column seeds) "
             "and the interval of the mean gap holds training noise (seeds) and evaluation noise, paired by seed: "
             "stats.group_delta, as `python -m scripts.compare --a ... --b ...` (docs/comparisons.md).")


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in rows if "gap" in r]
    depths = [r["depth"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.errorbar(depths, [r["gap"] for r in rows], yerr=yerr(rows, "gap", [r["ci"] for r in rows]), marker="o", capsize=4)
    for r in rows:  # each seed's pair, faint (one seed: the point itself)
        ax1.plot([r["depth"]] * len(r["seeds"]), [b - a for a, b in zip(r["runs"]["gpt"], r["runs"]["nag"])], "o", color="C0", alpha=0.25)
    ax1.axhline(0, color="gray", lw=0.8)
    seeds = any(len(r["seeds"]) > 1 for r in rows)
    ax1.set(xscale="log", xlabel="depth × width (block parameters held)", ylabel="NAG - GPT val bpb (below 0: NAG better)",
            title="NAG - GPT gap (faint: each seed), 95% interval" if seeds else "NAG - GPT gap against depth, 95% interval")
    for i, arch in enumerate(ARCH_PAIR):
        with_ci = [r for r in rows if "mean_ci" in r]  # several seeds: the mean's interval
        ax2.plot(depths, [r[f"{arch}_bpb"] for r in rows], marker="o", color=f"C{i}", label=arch.upper())
        ax2.errorbar([r["depth"] for r in with_ci], [r[f"{arch}_bpb"] for r in with_ci],
                     yerr=yerr(with_ci, f"{arch}_bpb", [r["mean_ci"][arch] for r in with_ci]), fmt="none", ecolor=f"C{i}", capsize=4)
        for r in rows:
            ax2.plot([r["depth"]] * len(r["runs"][arch]), r["runs"][arch], "o", color=f"C{i}", alpha=0.25)
    ax2.set(xscale="log", xlabel="depth × width", ylabel="val bpb",
            title="val bpb (faint: each run; line: the mean over seeds)" if seeds else "val bpb of each run (one FLOP budget)")
    ax2.legend()
    for ax in (ax1, ax2):
        ax.set_xticks(depths, [f"{r['depth']}\n×{r['dim']}" for r in rows])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def yerr(rows, key, cis):
    """Error bar lengths below and above each value; clipped at 0: a bootstrap interval of identical differences
    can miss its centre by a rounding error."""
    return [[max(0.0, r[key] - ci[0]) for r, ci in zip(rows, cis)], [max(0.0, ci[1] - r[key]) for r, ci in zip(rows, cis)]]


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
    path = os.path.join(base, "tokenizer", "tokenizer.pkl")
    if os.path.exists(path):
        from nanochat.tokenizer import get_tokenizer
        return get_tokenizer().get_vocab_size()
    return get_preset(SCALES["cpu"]["preset"])["vocab"]  # a dry run before the tokenizer exists


def main(argv=None):
    p = argparse.ArgumentParser(description="FLOP-matched GPT / NAG pairs across depths at a fixed block size",
                                epilog="--scale published: further flags go to speedrun.sh (e.g. --eval-bundle DIR)")
    p.add_argument("--scale", default="cpu", help="cpu or published")
    p.add_argument("--depths", default="", help="comma-separated depths (default: the scale's)")
    p.add_argument("--flops", type=float, default=None, help="FLOP budget of every run (default: the scale's)")
    p.add_argument("--gpus", type=int, default=8, help="published: processes per run (the plan's hours)")
    p.add_argument("--seeds", default=None, help="comma-separated seeds, e.g. 1,2,3: every pair once per seed (runs named -s<seed>, "
                                                 "--seed and --data-seed set from it); the gap is then the mean over seeds")
    p.add_argument("--base-dir", default=None, help="data, tokenizer, runs and the report (default $NANOCHAT_BASE_DIR or ~/.cache/nanochat)")
    p.add_argument("--dry-run", action="store_true", help="the plan only: nothing is trained or written")
    args, extra = p.parse_known_args(argv)
    with exit_on_user_error(interrupted="interrupted: finished runs and evaluations are kept; the same command "
                            "resumes the sweep (an unfinished run from its newest checkpoint)"):
        if args.scale not in SCALES:
            raise UserError(f"unknown --scale {args.scale!r} (expected cpu or published)")
        if args.scale == "cpu" and extra:
            raise UserError(f"unknown arguments for --scale cpu: {' '.join(extra)}")
        s = SCALES[args.scale]
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
        plan = plan_sweep(args.scale, depths, flops, vocab_size(args.scale, base), nproc, seeds)
        print(plan_table(plan), file=sys.stderr, flush=True)
        extra = ["--gpus", str(args.gpus), *extra] if args.scale == "published" else []
        if args.dry_run:
            print("\n".join(["", "commands:", *commands(plan, extra), "dry run: nothing was trained or written"]), file=sys.stderr)
            return plan
        if args.scale == "cpu":
            for row in plan["depths"]:
                for seed in seeds or [None]:
                    check_reusable(row, base, seed)
        failed = []  # named at the end: the other runs, seeds and depths go on
        for row in plan["depths"]:
            if args.scale == "cpu":
                for seed in seeds or [None]:
                    failed += run_cpu(row, flops, base, seed)
            elif not run_published(row, flops, extra, seeds):
                failed.append(f"speedrun.sh at depth {row['depth']}")
        rows = results(plan, base)
        text = results_table(rows)
        plot(rows, os.path.join(out_dir, "depth_gap.png"))
        atomic_write_json(os.path.join(out_dir, "depth_sweep.json"), {"plan": plan, "results": rows})
        with open(os.path.join(out_dir, "depth_sweep.md"), "w") as f:
            f.write(f"# Depth sweep ({args.scale})\n\nPlan:\n\n{plan_table(plan)}\n\nResults (val bpb, base_eval):\n\n{text}\n\n"
                    f"{INTERVALS}\n\n![NAG - GPT gap against depth](depth_gap.png)\n")
        print(text)
        print(f"report: {os.path.join(out_dir, 'depth_sweep.md')}", file=sys.stderr)
        if failed:
            raise UserError(f"failed: {', '.join(failed)} (rerun to retry them; finished runs are reused)")
        return rows


if __name__ == "__main__":
    main()
