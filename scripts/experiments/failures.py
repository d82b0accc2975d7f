"""
The two failure cases of the published NAG run, each beside its fixed twin, and a verdict table.

docs/failures.md describes both cases.

    python -m scripts.experiments.failures --scale cpu                 # tiny runs, minutes on a CPU
    python -m scripts.experiments.failures --scale cpu --seeds 1,2,3
    python -m scripts.experiments.failures --scale cpu --dry-run       # the CPU runs and their status
    python -m scripts.experiments.failures --scale published --dry-run # the four published runs (speedrun.sh)

Failure 1 (NaN), faithful: floor 0, gate LR = matrix LR, no α warm-up; twin: the same with the floor (1e-6) back.
Failure 2 (gate collapse): gate LR = matrix LR, no α warm-up; twin: gate LR = matrix LR / 12 (the published
1e-3 against Muon's 0.012) and the α warm-up. A rerun reuses every finished run (outcome.json in its directory).
--base-dir (default $NANOCHAT_BASE_DIR) is taken from the directory the command runs in, as in speedrun.sh.
"""

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys

from nanochat.common import UserError, exit_on_user_error, get_base_dir, base_dir_path, parse_seeds
from nanochat.nonfinite import NonFiniteError
from nanochat.dataset import list_parquet_files
from nanochat.run_dir import metrics_path, run_path
from nanochat.tokenizer import get_tokenizer, has_tokenizer
from nag import train_flags
from nag.gate_collapse import collapse_verdict, gate_rows
from nag.archs import plan_for
from nag.model import NAGGPT
from nag.presets import get_preset
from scripts import base_train, speedrun
from scripts.experiments import prepare_cpu_data

ARCH = NAGGPT.arch  # the published NAG model: the failures are its own

# The CPU scale, from the search in docs/failures.md: 8 blocks × 128 on the tiny preset's batch (256 tokens per
# step). A high matrix LR (= gate LR in the broken runs) stands in for width: a gate's logit moves ~d·lr per step,
# d = 640 published. Failure 1 needs u to underflow, so it gets twice failure 2's LR and twice the steps.
CPU = [
    "--preset",
    "tiny",
    "--depth",
    "8",
    "--model-dim",
    "128",
    "--nag-gate-log-every",
    "10",
    "--eval-every",
    "100000",
    "--save-every",
    "50",
]
CPU_STEPS = {"fail1": 200, "fail2": 100}
CPU_MATRIX_LR = {"fail1": 64.0, "fail2": 32.0}
CPU_WARMUP_TOKENS = 2560  # 10 steps of 256 tokens (published: ~300 of 9,400 steps)
# the published NaN run used the code's higher defaults (matrix 0.02, embedding 0.3, unembedding 0.008), the
# collapse and fixed runs 0.012 / 0.18 / 0.006 (docs/failures.md §3)
PUBLISHED_MATRIX_LR = {"fail1": 0.02, "fail2": 0.012}
# failure 1's extra flags. CPU: 8 preferred directions at width 128 keep the published C/d (32/640 = 0.05);
# with 32, a token needs all 32 logits below −87, and runcpu's corpus gave no NaN in 3 seeds (docs/failures.md)
FAIL1_EXTRA = {"cpu": ["--nag-directions", "8"], "published": ["--embedding-lr", "0.3", "--unembedding-lr", "0.008"]}
PUBLISHED_WARMUP_TOKENS = 314_572_800

FLOOR = 1e-6


def settings(scale):
    """[(case, role, label, base_train flags)]: each broken run, then its fixed twin."""
    out = []
    for case in ("fail1", "fail2"):
        lr = (CPU_MATRIX_LR if scale == "cpu" else PUBLISHED_MATRIX_LR)[case]
        warm = CPU_WARMUP_TOKENS if scale == "cpu" else PUBLISHED_WARMUP_TOKENS
        broken = ["--matrix-lr", f"{lr:g}", "--nag-gate-lr", f"{lr:g}", "--nag-alpha-warmup-tokens", "0"]
        if case == "fail1":
            broken += FAIL1_EXTRA[scale]
            more = ", C = 8" if scale == "cpu" else ", embedding LR 0.3, unembedding LR 0.008"
            out += [
                (
                    case,
                    "broken",
                    f"floor 0, gate LR = matrix LR {lr:g}, no warm-up{more}",
                    ["--nag-mod-floor", "0", *broken],
                ),
                (
                    case,
                    "fixed",
                    f"floor {FLOOR:g}, gate LR = matrix LR {lr:g}, no warm-up{more}",
                    ["--nag-mod-floor", f"{FLOOR:g}", *broken],
                ),
            ]
        else:
            fixed = [
                "--matrix-lr",
                f"{lr:g}",
                "--nag-gate-lr",
                f"{lr / 12:.4g}",
                "--nag-alpha-warmup-tokens",
                str(warm),
            ]
            out += [
                (
                    case,
                    "broken",
                    f"floor {FLOOR:g}, gate LR = matrix LR {lr:g}, no warm-up",
                    ["--nag-mod-floor", f"{FLOOR:g}", *broken],
                ),
                (
                    case,
                    "fixed",
                    f"floor {FLOOR:g}, gate LR {lr / 12:.4g} = matrix LR {lr:g} / 12, warm-up {warm:,} tokens",
                    ["--nag-mod-floor", f"{FLOOR:g}", *fixed],
                ),
            ]
    return out


def cpu_run(case, role, flags, seed):
    """(run name, base_train argv) of one tiny run. Its seed sets the init only (--seed): each run has its own
    verdict, and a data seed would change what these runs have always trained."""
    name = f"fail-{case}-{role}-s{seed}"
    return name, CPU + [
        "--num-iterations",
        str(CPU_STEPS[case]),
        "--arch",
        ARCH,
        "--run",
        name,
        "--seed",
        str(seed),
        "--resume",
        "latest",
        *flags,
    ]


def run_cpu(case, role, flags, seed, base):
    """Train one tiny run (or reuse its outcome.json); returns the outcome dict."""
    name, argv = cpu_run(case, role, flags, seed)
    run_dir = run_path(name, base)
    done = outcome_path(run_dir)
    if os.path.exists(done):
        out = json.load(open(done))
        if out.get("argv") != argv:
            raise UserError(f"{run_dir} was trained with other settings; delete it to run it again")
        return out
    os.makedirs(os.path.dirname(run_dir), exist_ok=True)
    error = None
    with open(run_dir + ".log", "a") as log, contextlib.redirect_stdout(log):
        try:
            base_train.train(train_flags.parse_args(argv))
        except NonFiniteError as e:
            error = str(e)
            print(f"error: {error}")  # the log ends as the command line's output would
    outcome = {"run": name, "seed": seed, "argv": argv, "error": error, **summarise(metrics_path(run_dir))}
    with open(done, "w") as f:
        json.dump(outcome, f)
    return outcome


def outcome_path(run_dir):
    return os.path.join(run_dir, "outcome.json")  # this driver's own file: a finished run's verdict inputs


def summarise(path):
    """The gate telemetry of a run's metrics.jsonl at `path`: the smallest u and the collapse verdict."""
    rows = gate_rows(path)
    u_min = min((b["u_min"] for r in rows for b in r["gate"]["branches"]), default=None)
    return {"u_min": u_min, "collapse": collapse_verdict(path)}


def verdict(case, role, out):
    """(outcome, verdict, number) of one run."""
    err = out["error"]
    if err:
        step = err.split(" at step ")[1].split()[0]
        origin = err.split("origin: ")[1] if "origin: " in err else "origin not found"
        outcome = f"non-finite at step {step}"
    else:
        outcome = "finite"
    u_min = f"min u {out['u_min']:.3g}" if out["u_min"] is not None else "no gate telemetry"
    c = out["collapse"]
    share = f"{c['share']:.0%} of branches shut mid-run to end" if c["share"] is not None else "no gate telemetry"
    if case == "fail1":
        if role == "broken":
            return outcome, "reproduced" if err else "not reproduced", origin if err else u_min
        return outcome, "twin holds" if not err else "twin fails", u_min if not err else origin
    if role == "broken":
        return outcome, "reproduced" if c["verdict"] == "collapsed" else "not reproduced", f"{c['verdict']}: {share}"
    holds = c["verdict"] != "collapsed" and not err
    return outcome, "twin holds" if holds else "twin fails", f"{c['verdict']}: {share}"


def table(rows):
    lines = ["| case | seed | settings | outcome | verdict | number |", "|---|---:|---|---|---|---|"]
    lines += [f"| {case} {role} | {seed} | {label} | {o} | {v} | {n} |" for case, role, seed, label, o, v, n in rows]
    return "\n".join(lines)


def cpu_plan(seeds, base):
    """The CPU runs without running them: name, steps, parameters, status, settings and base_train flags."""
    have_tokenizer = has_tokenizer(base)
    # the base dir's tokenizer, or the one prepare_cpu_data would train (the demo's vocab, as runcpu.sh)
    vocab = get_tokenizer().get_vocab_size() if have_tokenizer else get_preset("demo")["vocab"]
    data = (
        "present"
        if list_parquet_files(os.path.join(base, "base_data"))
        else "to build (the offline corpus, as runcpu.sh)"
    )
    tokenizer = f"{vocab:,} tokens" + ("" if have_tokenizer else ", to train")
    rows, commands = [], []
    for case, role, label, flags in settings("cpu"):
        for seed in seeds:
            name, argv = cpu_run(case, role, flags, seed)
            with contextlib.redirect_stdout(io.StringIO()):  # base_train's notes: in each run's log, once it trains
                plan = plan_for(train_flags.parse_args(argv), vocab, 1)
            run_dir = run_path(name, base)
            done = outcome_path(run_dir)
            if os.path.exists(done):
                status = "done (reused)" if json.load(open(done)).get("argv") == argv else "other settings (refused)"
            else:
                status = "started (resumes)" if os.path.isdir(run_dir) else "to do"
            params = sum(p.numel() for p in plan.model.parameters())
            rows.append(f"| {name} | {plan.num_iterations:,} | {params:,} | {status} | {label} |")
            commands.append(f"python -m scripts.base_train {' '.join(argv)}")
    runs = os.path.dirname(run_dir)  # where every run of the base dir lives
    lines = [
        f"failures --scale cpu: {len(seeds) * 4} runs in {runs}; data {data}; tokenizer {tokenizer}",
        "| run | steps | params | status | settings |",
        "|---|---:|---:|---|---|",
        *rows,
    ]
    return "\n".join(
        [*lines, "", "base_train flags of each run:", *commands, "dry run: nothing was trained or written"]
    )


def published(dry_run, extra, base):
    """The four runs at the published scale through speedrun.sh (run nag-published-<tag>), then the same table."""
    rows = []
    for case, role, label, flags in settings("published"):
        tag = f"{case}-{role}"
        cmd = [
            "bash",
            "speedrun.sh",
            "--preset",
            "published",
            "--arch",
            ARCH,
            "--tag",
            tag,
            *extra,
            *(["--dry-run"] if dry_run else []),
            "--",
            *flags,
        ]
        print(" ".join(cmd), file=sys.stderr)
        if dry_run:  # speedrun.sh's plan, made here (its plan file is speedrun.sh's only)
            speedrun.main(cmd[2:])
            continue
        proc = subprocess.run(cmd, stderr=subprocess.PIPE, text=True)
        sys.stderr.write(proc.stderr)
        errors = [line[len("error: ") :] for line in proc.stderr.splitlines() if line.startswith("error: non-finite")]
        if proc.returncode and not errors:
            raise UserError(f"the {tag} run failed for another reason (see above); rerun to resume it")
        run_dir = run_path(f"{ARCH}-published-{tag}", base)  # speedrun's name: <arch>-<preset>-<tag>
        out = {"error": errors[0] if errors else None, **summarise(metrics_path(run_dir))}
        rows.append((case, role, "-", label, *verdict(case, role, out)))
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(
        description="NAG's two failure cases beside their fixed twins, with verdicts",
        epilog="--scale published: further flags go to speedrun.sh (e.g. --gpus 8)",
    )
    p.add_argument("--scale", default="cpu", help="cpu or published")
    p.add_argument("--seeds", default=None, help="cpu: comma-separated seeds (default 1)")
    p.add_argument(
        "--base-dir", default=None, help="data, tokenizer and runs (default $NANOCHAT_BASE_DIR or ~/.cache/nanochat)"
    )
    p.add_argument("--dry-run", action="store_true", help="the plan only: nothing is trained or written")
    args, extra = p.parse_known_args(argv)
    with exit_on_user_error(
        interrupted="interrupted: finished runs are kept; the same command resumes (an unfinished "
        "run from its newest checkpoint)"
    ):
        base = base_dir_path(args.base_dir)
        os.environ["NANOCHAT_BASE_DIR"] = base  # for base_train here and speedrun.sh below
        if args.scale == "published":
            if args.seeds is not None:
                raise UserError("--seeds is for --scale cpu: the published scale runs each case once")
            rows = published(args.dry_run, extra, base)
        elif args.scale == "cpu":
            if extra:
                raise UserError(f"unknown arguments for --scale cpu: {' '.join(extra)}")
            seeds = parse_seeds("1" if args.seeds is None else args.seeds)
            if args.dry_run:
                print(cpu_plan(seeds, base), file=sys.stderr)
                return
            get_base_dir()  # created here, or one line saying why it cannot be
            prepare_cpu_data(base)
            rows = []
            for case, role, label, flags in settings("cpu"):
                for seed in seeds:
                    out = run_cpu(case, role, flags, seed, base)
                    rows.append((case, role, seed, label, *verdict(case, role, out)))
                    print(f"{case} {role} seed {seed}: {' | '.join(rows[-1][4:])}", file=sys.stderr, flush=True)
        else:
            raise UserError(f"unknown --scale {args.scale!r} (expected cpu or published)")
        if rows:
            print(table(rows))


if __name__ == "__main__":
    main()
