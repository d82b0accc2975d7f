"""
Evaluate a base model checkpoint of either arch: bits per byte on the val and train splits,
the CORE score (DCLM protocol, nanochat/core_eval.py) and a few fixed-prompt samples.

    python -m scripts.base_eval --run nag-tiny --max-per-task 20 --split-tokens 4096 --device-batch-size 4
    python -m scripts.base_eval --run nag-tiny --step 20 --eval bpb --split-tokens 4096 --device-batch-size 4
    torchrun --nproc_per_node=8 -m scripts.base_eval -- --run gpt-published   (GPU)

Writes into the run directory: eval.json (all results, with the per-batch val losses that
scripts.compare turns into a bpb interval), core_tasks.csv (one row per CORE task) and
core_records.parquet (every scored CORE example with the eval settings, for paired comparisons).
CORE results are saved after every task, so a crash keeps the tasks already finished.
With --mod-rate (a NAG checkpoint, or a router-MoD GPT one) it also evaluates the Mixture-of-Depths
trade-off: at each rate the skip thresholds are calibrated on train-split tokens, held fixed, and the
val bpb (and CORE, when --eval has it) is measured with the FLOPs actually executed (docs/mod.md):

    python -m scripts.base_eval --run nag-tiny --eval bpb --split-tokens 4096 --device-batch-size 4 --mod-rate 0.05,0.1,0.2,0.3,0.4 --mod-blocks both --mod-calib-tokens 8192

Sections not run this time (say `--eval sample`) keep their results from an earlier eval.json
of the same checkpoint step; an eval.json of another step is replaced whole.
A small --max-per-task (say 5) works: tasks then use fewer few-shot examples, with a note.
"""

import os
import io
import csv
import json
import argparse
import tempfile
import contextlib

import torch
import torch.distributed as dist

from nanochat.common import UserError, exit_on_user_error, script_argv, print0, dist_init, autodetect_device_type, compute_dtype_for, atomic_write_json, atomic_write_bytes
from nanochat.tokenizer import get_tokenizer, get_token_bytes
from nanochat.dataloader import data_loader
from nanochat.loss_eval import evaluate_bpb
from nanochat.stats import bpb_delta_interval, core_delta_interval
from nanochat.core_eval import ensure_eval_bundle, evaluate_core, save_records
from nanochat import checkpoint_manager as ckpt
from scripts.archs import load_model
from nag.mod import ModConfig, BLOCKS, check_rate, calibrate, skip_summary

EVALS = ("core", "bpb", "sample")
RECORDS = "core_records.parquet"
OUTPUTS = ("eval.json", "core_tasks.csv", RECORDS)
PROMPTS = [
    "The capital of France is",
    "The chemical symbol of gold is",
    "If yesterday was Friday, then tomorrow will be",
    "The opposite of hot is",
    "The planets of the solar system are:",
]
SAMPLE_TEMPERATURE = 0.8
SAMPLE_SEED = 42

# every field eval.json has, grouped by the --eval section that fills it
SECTION_FIELDS = {
    "bpb": {"val_bpb": None, "train_bpb": None, "split_tokens": None, "val_batches": None},
    "core": {"tasks": {}, "core_metric": None, "partial_core": None, "partial_label": None, "num_tasks_scored": 0,
             "missing_tasks": None, "max_per_task": None, "eval_bundle": None, "core_error": None,
             "core_records": None, "core_finished": None},
    "sample": {"samples": [], "sample_tokens": None, "sample_temperature": None, "sample_seed": None},
    "mod": {"mod_curve": None},
}


def build_parser():
    p = argparse.ArgumentParser(description="Evaluate a base model checkpoint: bpb, CORE, samples.")
    p.add_argument("--run", type=str, required=True, help="run name under $NANOCHAT_BASE_DIR/runs, or a path to a run directory")
    p.add_argument("--step", type=int, default=-1, help="checkpoint step (default: the latest)")
    p.add_argument("--eval", type=str, default="core,bpb,sample", help="comma-separated subset of core,bpb,sample")
    p.add_argument("--max-per-task", type=int, default=-1, help="CORE examples per task after the fixed shuffle (-1: all)")
    p.add_argument("--split-tokens", type=int, default=20 * 2 ** 19, help="tokens of each split (val, train) for bpb")
    p.add_argument("--device-batch-size", type=int, default=32, help="rows per forward (bpb and CORE)")
    p.add_argument("--eval-bundle", type=str, default="", help="CORE eval bundle dir (default: <base_dir>/eval_bundle, downloaded once)")
    p.add_argument("--sample-tokens", type=int, default=16, help="tokens generated per sample")
    p.add_argument("--device-type", type=str, default="", help="cuda|cpu|mps (default: autodetect)")
    p.add_argument("--mod-rate", type=str, default="", help="MoD trade-off curve: comma-separated target skip rates, e.g. 0.05,0.1,0.2")
    p.add_argument("--mod-blocks", type=str, default="both", choices=BLOCKS, help="sub-layers skipped along the curve")
    p.add_argument("--mod-calib-tokens", type=int, default=2 ** 20, help="train-split tokens that calibrate each rate's thresholds")
    return p


def parse_rates(text):
    """The curve's rates, sorted, with the full-depth point 0 first."""
    try:
        rates = [float(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise UserError(f"--mod-rate takes comma-separated numbers, got {text!r}") from None
    for r in rates:
        check_rate(r)
    return sorted(set([0.0] + rates))


def parse_evals(text):
    evals = [e.strip() for e in text.split(",") if e.strip()]
    unknown = [e for e in evals if e not in EVALS]
    if unknown or not evals:
        raise UserError(f"--eval takes a comma-separated subset of {','.join(EVALS)}, got {text!r}")
    return set(evals)



# ---------------------------------------------------------------------------
# the three evaluations


def eval_bpb(model, tokenizer, token_bytes, args, device, rank, world_size):
    B, T = args.device_batch_size, model.config.sequence_len
    steps = max(1, args.split_tokens // (B * T * world_size))
    out = {"split_tokens": steps * B * T * world_size, "val_batches": {}}
    for split in ("val", "train"):
        batches = data_loader(tokenizer, B, T, split, device=device, rank=rank, world_size=world_size)
        # val: per-batch losses too, on batches every run shares, for compare's paired interval
        out[f"{split}_bpb"] = evaluate_bpb(model, batches, steps, token_bytes, per_batch=out["val_batches"] if split == "val" else None)
        print0(f"{split} bpb: {out[f'{split}_bpb']:.4f} ({out['split_tokens']:,} tokens)")
    return out


def complete(model, tokenizer, prompt, max_tokens, temperature, seed):
    bos = tokenizer.get_bos_token_id()
    out = []
    for tok in model.generate(tokenizer.encode(prompt, prepend=bos), max_tokens, temperature=temperature, seed=seed):
        if tok == bos:  # the model started a new document: the completion is over
            break
        out.append(tok)
    return tokenizer.decode(out)


def eval_samples(model, tokenizer, max_tokens):
    samples = []
    for prompt in PROMPTS:
        greedy = complete(model, tokenizer, prompt, max_tokens, 0.0, SAMPLE_SEED)
        sampled = complete(model, tokenizer, prompt, max_tokens, SAMPLE_TEMPERATURE, SAMPLE_SEED)
        samples.append({"prompt": prompt, "greedy": greedy, "sampled": sampled})
        print0(f"{prompt!r}\n  greedy : {greedy!r}\n  sampled: {sampled!r}")
    return {"samples": samples, "sample_tokens": max_tokens, "sample_temperature": SAMPLE_TEMPERATURE, "sample_seed": SAMPLE_SEED}


def find_bundle(eval_bundle):
    """(bundle dir, None), or (None, reason) when the default bundle cannot be had (offline, no copy).
    An explicit --eval-bundle that is not a bundle is the user's mistake, so it stays an error."""
    if eval_bundle:
        return ensure_eval_bundle(eval_bundle), None
    try:
        return ensure_eval_bundle(None), None
    except UserError as e:
        return None, str(e)


def eval_core(model, tokenizer, device, bundle, args, save):
    """CORE fields of eval.json; save(fields, records, settings) is called after every task and at the end."""
    def fields(core, finished):
        keys = ("tasks", "core_metric", "partial_core", "partial_label", "num_tasks_scored", "missing_tasks")
        return {**{k: core[k] for k in keys}, "max_per_task": args.max_per_task, "eval_bundle": bundle,
                "core_error": None, "core_records": RECORDS, "core_finished": finished}

    core = evaluate_core(model, tokenizer, device, bundle, max_per_task=args.max_per_task, batch_size=args.device_batch_size,
                         log=print0, on_task=lambda c: save(fields(c, False), c["records"], c["settings"]))
    out = fields(core, True)
    save(out, core["records"], core["settings"])
    return out


def eval_mod_curve(model, tokenizer, token_bytes, args, device, rank, world_size, bundle):
    """The MoD trade-off: at each rate, thresholds calibrated on train-split tokens (never on the val tokens
    scored here) and then fixed, val bpb (and CORE), realised skip rates and the forward FLOPs executed."""
    B, T = args.device_batch_size, model.config.sequence_len
    steps = max(1, args.split_tokens // (B * T * world_size))
    calib_steps = max(1, args.mod_calib_tokens // (B * T * world_size))
    points, full_depth = [], {}
    for rate in parse_rates(args.mod_rate):  # 0 first: every other point is paired with it
        model.configure_mod(ModConfig(blocks=args.mod_blocks, rate=rate))
        if rate > 0:
            calibrate(model, data_loader(tokenizer, B, T, "train", device=device, rank=rank, world_size=world_size), calib_steps)
            if dist.is_initialized():  # every rank calibrated on its own shard: one set of thresholds for all
                dist.all_reduce(model.thresholds.values)
                model.thresholds.values /= world_size
        model.eval()
        val = data_loader(tokenizer, B, T, "val", device=device, rank=rank, world_size=world_size)
        batches = {}
        with torch.no_grad():
            bpb = evaluate_bpb(model, val, steps, token_bytes, per_batch=batches)
        rates = model.thresholds.pop_rates("eval") if model.thresholds is not None else {}
        flops = model.estimate_flops(rates) // 3  # forward only: a third of the training convention
        point = {"rate": rate, "blocks": args.mod_blocks, "val_bpb": bpb, **skip_summary(rates),
                 "forward_flops_per_token": flops, "calib_tokens": calib_steps * B * T * world_size if rate > 0 else 0}
        # the same val batches and CORE items at every rate: each point's cost against full depth, paired
        if rate == 0:
            full_depth["bpb"] = batches
        else:
            r = bpb_delta_interval(full_depth["bpb"]["nats"], batches["nats"], batches["bytes"])
            point["val_bpb_delta"], point["val_bpb_delta_ci"] = r["delta"], r["ci"]
        if bundle is not None:
            core = evaluate_core(model, tokenizer, device, bundle, max_per_task=args.max_per_task, batch_size=args.device_batch_size,
                                 log=lambda *a: None)
            point["core"] = core["core_metric"] if core["core_metric"] is not None else core["partial_core"]
            point["core_label"] = "CORE" if core["core_metric"] is not None else core["partial_label"]
            records = {k: [rec[k] for rec in core["records"]] for k in ("task", "idx", "correct")}
            if rate == 0:
                full_depth["core"] = records
            elif core["records"]:
                r = core_delta_interval(full_depth["core"], records, core["settings"])
                point["core_delta"], point["core_delta_ci"] = r["delta"], r["ci"]
        points.append(point)
    full = points[0]["forward_flops_per_token"]

    def delta(p, key):
        if f"{key}_delta" not in p:
            return ""
        lo, hi = p[f"{key}_delta_ci"]
        return f" (Δ {p[f'{key}_delta']:+.4f}, 95% CI {lo:+.4f} … {hi:+.4f})"

    for p in points:
        p["flops_frac"] = p["forward_flops_per_token"] / full
        print0(f"MoD {p['blocks']} rate {p['rate']:.2f}: val bpb {p['val_bpb']:.4f} | skipped attn {100 * p.get('skip_attn', 0):.1f}% "
               f"mlp {100 * p.get('skip_mlp', 0):.1f}% | forward FLOPs {100 * p['flops_frac']:.1f}% of full depth"
               + delta(p, "val_bpb") + (f" | {p['core_label']} {p['core']:.4f}" if "core" in p else "") + delta(p, "core"))
    return {"mod_curve": {"blocks": args.mod_blocks, "split_tokens": steps * B * T * world_size, "points": points}}


# ---------------------------------------------------------------------------
# output


def core_csv(tasks):
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["task", "accuracy", "centered", "num_examples"])
    for label, r in tasks.items():
        w.writerow([label, r["accuracy"], r["centered"], r["num_examples"]])
    return buf.getvalue()


def previous_results(path, step):
    """The earlier eval.json of this same step (its sections not re-run are kept), else {}."""
    if not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            old = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return {}  # unreadable: it is rewritten from scratch
    return old if isinstance(old, dict) and old.get("step") == step else {}


def print_table(record):
    lines = []
    if record["tasks"]:
        lines.append(f"{'task':<34} {'accuracy':>9} {'centred':>9}")
        for label, r in record["tasks"].items():
            lines.append(f"{label:<34} {r['accuracy']:>9.4f} {r['centered']:>+9.4f}")
        for label in record["missing_tasks"] or []:
            lines.append(f"{label:<34} {'missing':>9} {'':>9}")
        if record["core_metric"] is not None:
            lines.append(f"{'CORE':<34} {'':>9} {record['core_metric']:>9.4f}")
        else:  # fewer than 22 tasks: never call it CORE
            lines.append(f"{record['partial_label']:<34} {'':>9} {record['partial_core']:>9.4f}")
    elif record["core_error"]:
        lines.append(f"CORE not evaluated: {record['core_error']}")
    for key in ("val_bpb", "train_bpb"):
        if record[key] is not None:
            lines.append(f"{key.replace('_', ' '):<34} {record[key]:>9.4f}")
    print0("\n".join(lines))


def check_writable(run_dir):
    """Every output of base_eval can be written (a temp file in run_dir, renamed over each): checked
    before any work, so that no evaluation is thrown away at the end."""
    try:
        fd, tmp = tempfile.mkstemp(dir=run_dir, prefix=".tmp-write-check-")
        os.close(fd)
        os.remove(tmp)
    except OSError as e:
        raise UserError(f"cannot write into {run_dir} ({e.strerror}); base_eval writes its results there") from None
    for name in OUTPUTS:
        path = os.path.join(run_dir, name)
        if os.path.isdir(path):
            raise UserError(f"cannot write {path}: it is a directory; move it away and retry")


def evaluate(args):
    evals = parse_evals(args.eval)
    if args.device_batch_size < 1 or args.split_tokens < 1 or args.sample_tokens < 1 or args.mod_calib_tokens < 1:
        raise UserError("--device-batch-size, --split-tokens, --sample-tokens and --mod-calib-tokens must be positive")
    if args.mod_rate:
        parse_rates(args.mod_rate)
    device_type = args.device_type or autodetect_device_type()
    is_ddp, rank, _, world_size, device = dist_init(device_type)
    run_dir = ckpt.resolve_run_dir(args.run)
    if not os.path.isdir(run_dir):
        raise UserError(f"run directory {run_dir} does not exist")
    if rank == 0:
        check_writable(run_dir)
    # rank 0 holds the run's lock for the whole evaluation: a training process or another evaluation of
    # this run makes it stop here, before any work, rather than interleave writes
    with ckpt.run_lock(run_dir, "evaluation") if rank == 0 else contextlib.nullcontext():
        record = evaluate_locked(args, evals, device_type, rank, world_size, device, run_dir)
    if is_ddp:
        dist.destroy_process_group()
    return record


def evaluate_locked(args, evals, device_type, rank, world_size, device, run_dir):
    tokenizer = get_tokenizer()
    model, meta = load_model(run_dir, None if args.step < 0 else args.step, device)
    ckpt.check_vocab(meta, tokenizer)
    if args.mod_rate and not hasattr(model, "configure_mod"):
        raise UserError(f"--mod-rate: {run_dir} holds a {meta['arch']!r} checkpoint, which has no router to score tokens by "
                        "(train the router-MoD baseline with --mod-router, or use a NAG checkpoint)")
    model.set_compute_dtype(compute_dtype_for(device_type))
    if "tokens" in meta:  # NAG's alpha warm-up is a function of tokens seen: evaluate the model as it was trained
        model.set_tokens_seen(meta["tokens"])
    step = meta["step"]
    print0(f"evaluating {run_dir} step {step} ({meta['arch']}) on {device_type} × {world_size}: {', '.join(e for e in EVALS if e in evals)}")

    bundle, core_error = find_bundle(args.eval_bundle) if "core" in evals else (None, None)
    if core_error:
        print0(f"CORE skipped: {core_error}")

    eval_path = os.path.join(run_dir, "eval.json")
    records_path = os.path.join(run_dir, RECORDS)
    record = {"run": os.path.basename(os.path.normpath(run_dir)), "step": step, "arch": meta["arch"], "tokens": meta.get("tokens")}
    old = previous_results(eval_path, step)
    for fields in SECTION_FIELDS.values():
        record.update({k: old.get(k, default) for k, default in fields.items()})

    def save(results, records=None, settings=None):
        """Merge results into the record and write it; CORE records go next to it, with the settings."""
        record.update(results)
        if rank != 0:
            return
        if records is not None:
            save_records(records_path, records, {**settings, "step": step, "run": record["run"]}, atomic_write_bytes)
        elif record["core_records"] is None and os.path.exists(records_path):
            os.remove(records_path)  # records of another step or an earlier CORE run: they no longer match eval.json
        atomic_write_json(eval_path, record)
        # rewritten every time, so it always matches eval.json (a header alone when CORE has no results)
        atomic_write_bytes(os.path.join(run_dir, "core_tasks.csv"), core_csv(record["tasks"]).encode())

    if "bpb" in evals:
        save(eval_bpb(model, tokenizer, get_token_bytes(device=device), args, device, rank, world_size))
    if bundle is not None:
        eval_core(model, tokenizer, device, bundle, args, save)
    elif core_error:
        save({"core_error": core_error})
    if "sample" in evals:
        save(eval_samples(model, tokenizer, args.sample_tokens) if rank == 0 else {})
    if args.mod_rate:  # last: it reconfigures the model's MoD
        save(eval_mod_curve(model, tokenizer, get_token_bytes(device=device), args, device, rank, world_size, bundle))
    if rank == 0:
        print_table(record)
        print0(f"wrote {eval_path}")
    return record


def main(argv=None):
    args = build_parser().parse_args(script_argv(argv))
    with exit_on_user_error():
        return evaluate(args)


if __name__ == "__main__":
    main()
