"""
Residual geometry, attention sinks and confidence of trained checkpoints, GPT and NAG side by side.

    python -m analysis gpt-tiny nag-tiny --tokens 4096 --clusters 4 --state-sample 64 --device-batch-size 4
    python -m analysis gpt-published nag-published --tokens 1048576 --out /tmp/geometry   (GPU)

Each RUN is a run name under $NANOCHAT_BASE_DIR/runs or a path to a run directory. One no-grad pass over
validation tokens per run (analysis/capture.py), then analysis.json (every number), PNG figures and
analysis.md (a table beside the paper's and walkthrough's numbers) in --out (default
$NANOCHAT_BASE_DIR/reports/analysis_<run1>@<step>_vs_<run2>@<step>, named by the runs and steps analysed, the
folder scripts.compare links from a report of those runs at those steps), with inputs.json, its manifest.
An analysis of other inputs or settings in that folder moves to its replaced/ first, and so does a file it wrote
that was changed since (the manifest keeps each one's sha256); a folder holding files the analysis did not write is
refused unless --force. docs/analysis.md explains each measure.
"""

import os
import sys
import json
import math
import time
import argparse

import torch

from nanochat.common import (
    UserError,
    exit_on_user_error,
    get_base_dir,
    autodetect_device_type,
    compute_dtype_for,
    atomic_write_bytes,
    ensure_writable_dir,
    parse_checked,
    positive_int,
    STEP,
)
from nanochat.run_dir import folder_name, claim_folder, staging, publish, existing_run_dir, check_folder_path
from nanochat import checkpoint_manager as ckpt
from nanochat.loss_eval import held_batches
from nag.archs import load_model
from analysis.capture import CaptureConfig, capture
from analysis.summary import summarise
from analysis.figures import make_figures
from analysis.report import markdown

TOOL = "analysis"  # the manifest's tool: a folder this command wrote
# what else its numbers depend on
SETTINGS = ("tokens", "clusters", "state_sample", "token_sample", "device_batch_size", "seed")


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="python -m analysis",
        description=(
            "Residual geometry, attention sinks and confidence of checkpoints: analysis.json + figures + analysis.md."
        ),
    )
    p.add_argument(
        "runs", nargs="+", metavar="RUN", help="run name under $NANOCHAT_BASE_DIR/runs, or a path to a run directory"
    )
    p.add_argument("--step", type=STEP, default=-1, help="checkpoint step of every run (-1: each run's latest)")
    p.add_argument(
        "--tokens", type=positive_int, default=65536, help="validation tokens per run (rounded down to whole batches)"
    )
    p.add_argument(
        "--clusters",
        type=positive_int,
        default=32,
        help="spherical k-means clusters for the norm spread (paper Table III)",
    )
    p.add_argument(
        "--state-sample", type=positive_int, default=1024, help="tokens whose residual vectors are kept for clustering"
    )
    p.add_argument(
        "--token-sample",
        type=positive_int,
        default=65536,
        help="tokens whose per-token scalars are kept (percentiles, deciles, AUROC)",
    )
    p.add_argument("--device-batch-size", type=positive_int, default=8, help="sequences per forward pass")
    p.add_argument("--seed", type=int, default=0, help="seed of the token samples and of k-means")
    p.add_argument(
        "--out",
        type=str,
        default=None,
        help="output directory (default: $NANOCHAT_BASE_DIR/reports/"
        "analysis_<run1>@<step>_vs_<run2>@<step>); an earlier analysis of other inputs there moves to its replaced/",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="write into a folder that holds files the analysis did not write "
        "(its files of the names written are replaced)",
    )
    p.add_argument("--device-type", type=str, default="", help="cuda|cpu|mps (default: autodetect)")
    return parse_checked(p, argv)


class Progress:
    """One self-overwriting stderr line per run: batches done, tokens/s, ETA."""

    def __init__(self, name, tokens_per_batch):
        self.name, self.tpb, self.t0 = name, tokens_per_batch, time.time()

    def __call__(self, done, total):
        dt = time.time() - self.t0
        eta = dt / done * (total - done)
        end = "\n" if done == total else ""
        print(
            f"\r{self.name}: batch {done}/{total} | {done * self.tpb / max(dt, 1e-9):,.0f} tok/s | "
            f"{dt:.1f}s elapsed, ETA {eta:.1f}s   ",
            end=end,
            file=sys.stderr,
            flush=True,
        )


def check_runs(args, tokenizer):
    """Every run exists, has the checkpoint asked for and matches the tokenizer; checked before any pass or write."""
    plans, names, notes = [], [], []
    for run in args.runs:
        run_dir = existing_run_dir(run)
        step = ckpt.latest_step(run_dir) if args.step < 0 else args.step
        meta = ckpt.load_meta(run_dir, step)
        ckpt.check_vocab(meta, tokenizer)  # also catches runs trained with different tokenizers
        T = meta["model_config"]["sequence_len"]
        per_batch = args.device_batch_size * T
        if args.tokens < per_batch:
            raise UserError(
                f"--tokens {args.tokens} is smaller than one batch of {run} "
                f"({args.device_batch_size} × {T} = {per_batch} tokens); raise --tokens or lower --device-batch-size"
            )
        batches = args.tokens // per_batch
        held = held_batches(tokenizer, args.device_batch_size, T, "val", batches)
        if held < batches:  # a small split would be cycled over: analyse what it holds, once
            notes.append(
                f"note: the val split holds about {held * per_batch:,} tokens for {run}, fewer than "
                f"--tokens {args.tokens:,}; analysing those"
            )
            batches = held
        sampled = min(args.state_sample, batches * per_batch)
        if args.clusters > sampled:
            raise UserError(
                f"--clusters {args.clusters} is larger than the {sampled} sampled states of {run}; "
                "lower --clusters or raise --state-sample / --tokens"
            )
        name = os.path.basename(os.path.normpath(run_dir))
        if name in names:
            raise UserError(f"two runs are named {name}; analyse runs with different names")
        names.append(name)
        plans.append(dict(run=run, name=name, dir=run_dir, step=step, batches=batches, T=T))
    for note in notes:  # only once every run has passed its checks: an error stays the one line printed
        print(note, file=sys.stderr)
    return plans


def analyse_run(plan, args, tokenizer, device):
    from nanochat.dataloader import data_loader

    model, meta = load_model(plan["dir"], plan["step"], device)
    model.set_compute_dtype(compute_dtype_for(device.type))
    if "tokens" in meta:
        model.set_tokens_seen(meta["tokens"])  # NAG: the α warm-up factor of that checkpoint
    B, T = args.device_batch_size, plan["T"]
    batches = data_loader(tokenizer, B, T, "val", device=device, one_pass=True)  # as held_batches counts
    cfg = CaptureConfig(token_sample=args.token_sample, state_sample=args.state_sample, seed=args.seed)
    t0 = time.time()
    acc = capture(model, batches, plan["batches"], tokenizer.get_bos_token_id(), cfg, Progress(plan["name"], B * T))
    seconds = time.time() - t0
    result = summarise(acc, model, args.clusters, args.seed)
    result.update(run_dir=plan["dir"], step=plan["step"], capture_seconds=seconds, device=str(device))
    return result


def _finite(obj):
    """NaN / inf become null: analysis.json stays strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def inputs_of(plans, args):
    """What an analysis is made of, for its manifest: each run's directory and step, and the settings."""
    return {
        "runs": [{"dir": os.path.realpath(p["dir"]), "step": p["step"]} for p in plans],
        **{k: getattr(args, k) for k in SETTINGS},
    }


def default_out_dir(plans):
    """Named by the runs and steps analysed, as the reports are: an analysis of other steps goes elsewhere."""
    return os.path.join(get_base_dir(), "reports", "analysis_" + folder_name([(p["name"], p["step"]) for p in plans]))


def write_outputs(results, out_dir, cmdline, inputs, aside):
    """Everything is made in a temp directory next to out_dir, then moved in: a failure leaves no partial output."""
    with staging(out_dir) as tmp:
        figures = make_figures(results, tmp)
        data = {"command": cmdline, "runs": _finite(results)}
        atomic_write_bytes(os.path.join(tmp, "analysis.json"), (json.dumps(data, indent=1) + "\n").encode())
        atomic_write_bytes(os.path.join(tmp, "analysis.md"), markdown(results, figures, cmdline).encode())
        publish(tmp, out_dir, TOOL, inputs, aside)


def check_writable(out_dir):
    """write_outputs can do its work (a temp folder next to out_dir, then moved into it): checked before the
    pass, so that no analysis is thrown away for want of a place to put it."""
    check_folder_path(out_dir)  # a file there is named as such, not taken for a place that cannot be written
    ensure_writable_dir(os.path.dirname(os.path.abspath(out_dir)))
    if os.path.exists(out_dir):
        ensure_writable_dir(out_dir)


def analyse(args, cmdline):
    from nanochat.tokenizer import get_tokenizer

    tokenizer = get_tokenizer()
    plans = check_runs(args, tokenizer)
    out_dir = args.out or default_out_dir(plans)
    check_writable(out_dir)
    inputs = inputs_of(plans, args)
    aside = claim_folder(out_dir, TOOL, inputs, args.force)
    device = torch.device(args.device_type or autodetect_device_type())
    results = {}
    for plan in plans:
        results[plan["name"]] = analyse_run(plan, args, tokenizer, device)
    write_outputs(results, out_dir, cmdline, inputs, aside)
    with open(os.path.join(out_dir, "analysis.md"), encoding="utf-8") as f:
        print(f.read())
    print(f"wrote {out_dir}/analysis.json, analysis.md and figures")
    return out_dir


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    with exit_on_user_error():
        return analyse(args, " ".join(["python -m analysis"] + argv))


if __name__ == "__main__":
    main()
