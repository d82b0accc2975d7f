"""
Evaluate a base model checkpoint of any arch: bits per byte, the CORE score and samples.

It measures bits per byte on the val and train splits,
the CORE score (DCLM protocol, nanochat/core_eval.py) and a few fixed-prompt samples.

    python -m scripts.base_eval --run nag-tiny --max-per-task 20 --split-tokens 4096 --device-batch-size 4
    python -m scripts.base_eval --run nag-tiny --step 20 --eval bpb --split-tokens 4096 --device-batch-size 4
    torchrun --nproc_per_node=8 -m scripts.base_eval -- --run gpt-published   (GPU)

Each evaluated step keeps its results in the run directory's eval/: step_NNNNNN.json (all results, with
the per-batch val losses that scripts.compare turns into a bpb interval, the tokenizer and data
fingerprints they were measured with and the number of processes), step_NNNNNN_core_tasks.csv (one row
per CORE task) and step_NNNNNN_core_records.parquet (every scored CORE example with the eval settings, for
paired comparisons). eval.json, core_tasks.csv and core_records.parquet at the top of the run directory
are copies of the highest step evaluated: evaluating an earlier step changes neither them nor any other
step's files. The bpb batches are those one process reads, whatever the number of processes, and never
more than the split holds. CORE results are saved after every task: a run stopped early (Ctrl-C, SIGTERM,
a crash, a kill) is marked "interrupted", with the tasks it did not reach, and the same command resumes it at the
first unfinished task. An output that closes (`| head -20`) stops nothing: the lines are dropped and the
evaluation finishes. With --skip-done only what the step's results lack at these settings is measured (a section
held whole, CORE finished on every task of the bundle, is kept): what a recipe's rerun uses. Figures printed that
this command did not measure (kept, or CORE kept while the bundle cannot be had) are marked as earlier ones.
With --mod-rate (a NAG checkpoint, or a router-MoD GPT one) it also evaluates the Mixture-of-Depths
trade-off: at each rate the skip thresholds are calibrated on train-split tokens, held fixed, and the
val bpb (and CORE, when --eval has it) is measured with the FLOPs actually executed (docs/mod.md):

    python -m scripts.base_eval --run nag-tiny --eval bpb --split-tokens 4096 --device-batch-size 4 --mod-rate 0.05,0.1,0.2,0.3,0.4 --mod-blocks both --mod-calib-tokens 8192

Sections not run this time (say `--eval sample`) keep their results from an earlier evaluation of the
same step, unless that one was measured with another tokenizer or data (fingerprints): then the step's
earlier files move to eval/replaced/ and its results are replaced whole. A step that already has results
is never overwritten by a half-done evaluation: the new files are written to eval/pending/ and moved into
place once it finishes; the earlier files move to eval/replaced/ first when a section re-run now was measured
with other settings (--max-per-task, --split-tokens, ...), with a line saying so.
A small --max-per-task (say 5) works: tasks then use fewer few-shot examples, with a note.
"""

import os
import signal
import argparse
import tempfile
import contextlib

import torch
import torch.distributed as dist

from nanochat.common import (
    UserError,
    exit_on_user_error,
    script_argv,
    print0,
    dist_init,
    autodetect_device_type,
    compute_dtype_for,
    Progress,
    parse_checked,
    positive_int,
    positive_or_unset,
    STEP,
)
from nanochat.tokenizer import get_tokenizer, get_token_bytes
from nanochat.dataloader import data_loader
from nanochat.loss_eval import held_batches, shared_batches, evaluate_bpb_shared
from nanochat.stats import bpb_delta_interval, core_delta_interval
from nanochat.core_eval import ensure_eval_bundle, evaluate_core, load_records, records_by_task, scorable_tasks
from nanochat.flash_attention import CHOICES as ATTN_CHOICES, resolve_attention
from nanochat import checkpoint_manager as ckpt
from nanochat.run_dir import (
    EVAL_DIR,
    PENDING,
    TOP,
    step_files,
    evaluated_steps,
    check_layout,
    previous_results,
    read_pending,
    write_results,
    commit_pending,
    read_record,
    resolve_run_dir,
)
from nag.archs import load_model
from nag.mod import ModConfig, BLOCKS, check_rate, calibrate, skip_summary

EVALS = ("core", "bpb", "sample")
PROMPTS = [
    "The capital of France is",
    "The chemical symbol of gold is",
    "If yesterday was Friday, then tomorrow will be",
    "The opposite of hot is",
    "The planets of the solar system are:",
]
SAMPLE_TEMPERATURE = 0.8
SAMPLE_SEED = 42

# every field of a step's results, grouped by the --eval section that fills it (besides run, step, arch, tokens,
# fingerprints, checkpoint_fingerprints, world_size and measured_with, which every evaluation sets)
SECTION_FIELDS = {
    "bpb": {
        "val_bpb": None,
        "train_bpb": None,
        "split_tokens": None,
        "train_split_tokens": None,
        "num_val_batches": None,
        "bpb_batch_shape": None,
        "val_batches": None,
    },
    "core": {
        "tasks": {},
        "core_metric": None,
        "partial_core": None,
        "partial_label": None,
        "num_tasks_scored": 0,
        "missing_tasks": None,
        "max_per_task": None,
        "eval_bundle": None,
        "core_error": None,
        "core_records": None,
        "core_finished": None,
        "interrupted": None,
        "interrupted_tasks": None,
    },
    "sample": {"samples": [], "sample_tokens": None, "sample_temperature": None, "sample_seed": None},
    "mod": {"mod_curve": None},
}
# whether an earlier record holds results of a section
HAS_RESULTS = {
    "bpb": lambda r: r.get("val_bpb") is not None,
    "core": lambda r: bool(r.get("tasks")) or r.get("core_finished") is not None,
    "sample": lambda r: bool(r.get("samples")),
    "mod": lambda r: r.get("mod_curve") is not None,
}


def build_parser():
    p = argparse.ArgumentParser(description="Evaluate a base model checkpoint: bpb, CORE, samples.")
    p.add_argument(
        "--run", type=str, required=True, help="run name under $NANOCHAT_BASE_DIR/runs, or a path to a run directory"
    )
    p.add_argument("--step", type=STEP, default=-1, help="checkpoint step (-1: the latest)")
    p.add_argument("--eval", type=str, default="core,bpb,sample", help="comma-separated subset of core,bpb,sample")
    p.add_argument(
        "--max-per-task",
        type=positive_or_unset(int, "all items"),
        default=-1,
        help="CORE examples per task after the fixed shuffle, a positive number; -1 (the default): all of them",
    )
    p.add_argument(
        "--split-tokens", type=positive_int, default=20 * 2**19, help="tokens of each split (val, train) for bpb"
    )
    p.add_argument("--device-batch-size", type=positive_int, default=32, help="rows per forward (bpb and CORE)")
    p.add_argument(
        "--eval-bundle",
        type=str,
        default="",
        help="CORE eval bundle dir (default: <base_dir>/eval_bundle, downloaded once)",
    )
    p.add_argument("--sample-tokens", type=positive_int, default=16, help="tokens generated per sample")
    p.add_argument(
        "--skip-done",
        action="store_true",
        help=(
            "evaluate only what the step's results lack: a section they hold whole and measured with these settings "
            "(CORE finished on every task the bundle has, bpb, samples) is kept, not measured again; what a rerun "
            "of a recipe wants (runs/runcpu.sh)"
        ),
    )
    p.add_argument("--device-type", type=str, default="", help="cuda|cpu|mps (default: autodetect)")
    p.add_argument(
        "--attn",
        type=str,
        default="auto",
        choices=list(ATTN_CHOICES),
        help=(
            "attention kernel of bpb (auto: on Hopper the fastest of sdpa and each of cudnn, fa4, fa3 that loads, "
            "timed at start; elsewhere SDPA; CORE's packed rows use masks)"
        ),
    )
    p.add_argument(
        "--mod-rate",
        type=str,
        default="",
        help="MoD trade-off curve: comma-separated target skip rates, e.g. 0.05,0.1,0.2",
    )
    p.add_argument("--mod-blocks", type=str, default="both", choices=BLOCKS, help="sub-layers skipped along the curve")
    p.add_argument(
        "--mod-calib-tokens",
        type=positive_int,
        default=2**20,
        help="train-split tokens that calibrate each rate's thresholds",
    )
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


def split_batches(tokenizer, B, T, split, args, device, rank, world_size, note=True):
    """(n, this rank's share) of the --split-tokens batches of a split as one process reads it (nanochat.loss_eval):
    the same batches whatever the number of processes, and no more than the split holds (with a note)."""
    wanted = max(1, args.split_tokens // (B * T))
    n = held_batches(tokenizer, B, T, split, wanted)
    if n < wanted and note:
        print0(
            f"note: the {split} split holds about {n * B * T:,} tokens ({n} batches of {B}×{T}), fewer than "
            f"--split-tokens {args.split_tokens:,}; its bpb uses those"
        )
    # every rank reads the whole stream on the CPU; only its own batches go to the device
    return n, shared_batches(data_loader(tokenizer, B, T, split, one_pass=True), n, rank, world_size, device)


def eval_bpb(model, tokenizer, token_bytes, args, device, rank, world_size):
    B, T = args.device_batch_size, model.config.sequence_len
    out = {"bpb_batch_shape": [B, T]}
    for split in ("val", "train"):
        per_batch = {}
        n, batches = split_batches(tokenizer, B, T, split, args, device, rank, world_size)
        bpb = evaluate_bpb_shared(
            model, batches, token_bytes, per_batch, progress=Progress(f"{split} bpb", n, "batches")
        )
        out[f"{split}_bpb"] = bpb
        if split == "val":  # per-batch losses too, on batches every run shares, for compare's paired interval
            out.update(split_tokens=n * B * T, num_val_batches=n, val_batches=per_batch)
        else:
            out["train_split_tokens"] = n * B * T
        print0(f"{split} bpb: {bpb:.4f} ({n * B * T:,} tokens)")
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
    return {
        "samples": samples,
        "sample_tokens": max_tokens,
        "sample_temperature": SAMPLE_TEMPERATURE,
        "sample_seed": SAMPLE_SEED,
    }


def find_bundle(eval_bundle):
    """(bundle dir, None), or (None, reason) when the default bundle cannot be had (offline, no copy).
    An explicit --eval-bundle that is not a bundle is the user's mistake, so it stays an error."""
    if eval_bundle:
        return ensure_eval_bundle(eval_bundle), None
    try:
        return ensure_eval_bundle(None), None
    except UserError as e:
        return None, str(e)


def eval_core(model, tokenizer, device, bundle, args, save, records_name, done=None):
    """CORE fields of a step's results; save(fields, records, settings) is called after every task and at the end.
    Until the last task is done the saved fields say "interrupted": true, with the tasks not reached yet, so
    that a run stopped any way (Ctrl-C, SIGTERM, a crash, a kill) is never read as a finished one.
    done: the unfinished run to resume (unfinished_core)."""

    def fields(core, finished):
        keys = ("tasks", "core_metric", "partial_core", "partial_label", "num_tasks_scored", "missing_tasks")
        return {
            **{k: core[k] for k in keys},
            "max_per_task": args.max_per_task,
            "eval_bundle": bundle,
            "core_error": None,
            "core_records": records_name,
            "core_finished": finished,
            "interrupted": not finished,
            "interrupted_tasks": [] if finished else core["unfinished_tasks"],
        }

    core = evaluate_core(
        model,
        tokenizer,
        device,
        bundle,
        max_per_task=args.max_per_task,
        batch_size=args.device_batch_size,
        log=print0,
        # after the last task the results are whole: a stop before the final save leaves them finished
        on_task=lambda c: save(fields(c, not c["unfinished_tasks"]), c["records"], c["settings"]),
        done=done,
    )
    out = fields(core, True)
    save(out, core["records"], core["settings"])
    return out


def eval_mod_curve(model, tokenizer, token_bytes, args, device, rank, world_size, bundle):
    """The MoD trade-off: at each rate, thresholds calibrated on train-split tokens (never on the val tokens
    scored here) and then fixed, val bpb (and CORE), realised skip rates and the forward FLOPs executed."""
    B, T = args.device_batch_size, model.config.sequence_len
    calib_steps = max(1, args.mod_calib_tokens // (B * T * world_size))
    points, full_depth = [], {}
    for rate in parse_rates(args.mod_rate):  # 0 first: every other point is paired with it
        model.configure_mod(ModConfig(blocks=args.mod_blocks, rate=rate))
        if rate > 0:
            calibrate(
                model,
                data_loader(tokenizer, B, T, "train", device=device, rank=rank, world_size=world_size),
                calib_steps,
            )
            if dist.is_initialized():  # every rank calibrated on its own shard: one set of thresholds for all
                dist.all_reduce(model.thresholds.values)
                model.thresholds.values /= world_size
        model.eval()
        # the same at every rate
        steps, val = split_batches(tokenizer, B, T, "val", args, device, rank, world_size, note=rate == 0)
        batches = {}
        with torch.no_grad():
            bpb = evaluate_bpb_shared(model, val, token_bytes, per_batch=batches)
        rates = model.thresholds.pop_rates("eval") if model.thresholds is not None else {}
        flops = model.estimate_flops(rates) // 3  # forward only: a third of the training convention
        point = {
            "rate": rate,
            "blocks": args.mod_blocks,
            "val_bpb": bpb,
            **skip_summary(rates),
            "forward_flops_per_token": flops,
            "calib_tokens": calib_steps * B * T * world_size if rate > 0 else 0,
        }
        # the same val batches and CORE items at every rate: each point's cost against full depth, paired
        if rate == 0:
            full_depth["bpb"] = batches
        else:
            r = bpb_delta_interval(full_depth["bpb"]["nats"], batches["nats"], batches["bytes"])
            point["val_bpb_delta"], point["val_bpb_delta_ci"] = r["delta"], r["ci"]
        if bundle is not None:
            core = evaluate_core(
                model,
                tokenizer,
                device,
                bundle,
                max_per_task=args.max_per_task,
                batch_size=args.device_batch_size,
                log=lambda *a: None,
            )
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
        print0(
            f"MoD {p['blocks']} rate {p['rate']:.2f}: val bpb {p['val_bpb']:.4f} | skipped attn "
            f"{100 * p.get('skip_attn', 0):.1f}% mlp {100 * p.get('skip_mlp', 0):.1f}% | forward FLOPs "
            f"{100 * p['flops_frac']:.1f}% of full depth"
            + delta(p, "val_bpb")
            + (f" | {p['core_label']} {p['core']:.4f}" if "core" in p else "")
            + delta(p, "core")
        )
    return {"mod_curve": {"blocks": args.mod_blocks, "split_tokens": steps * B * T, "points": points}}


# ---------------------------------------------------------------------------
# output: the step's files in eval/ and their top-level copies (nanochat/run_dir.py writes them)


def current_fingerprints(tokenizer):
    """The tokenizer and data the numbers are measured with (nanochat.checkpoint_manager.fingerprints); the data
    ones are None where the base dir has no data (a CORE-only evaluation needs none)."""
    try:
        return ckpt.fingerprints(tokenizer)
    except UserError:
        return {"tokenizer": tokenizer.fingerprint(), "data_train": None, "data_val": None}


def measured_with(args, bundle, world_size):
    """What each section's numbers depend on besides the checkpoint and the fingerprints: a step's earlier results
    of a section measured otherwise are replaced, not merged, and kept in eval/replaced/."""
    bpb = {"split_tokens": args.split_tokens, "device_batch_size": args.device_batch_size}
    core = {"max_per_task": args.max_per_task, "eval_bundle": bundle}
    mod = {
        "mod_rate": parse_rates(args.mod_rate) if args.mod_rate else None,
        "mod_blocks": args.mod_blocks,
        "mod_calib_tokens": args.mod_calib_tokens,
        "world_size": world_size,
    }  # each rank calibrates on its own shard
    return {"bpb": bpb, "core": core, "sample": {"sample_tokens": args.sample_tokens}, "mod": {**bpb, **core, **mod}}


def changed_settings(old, now, sections):
    """The sections re-run now whose earlier results were measured with other settings, in words ("" if none)."""
    was, changes = old.get("measured_with") or {}, []
    for s in sections:
        if HAS_RESULTS[s](old) and was.get(s) != now[s]:
            diff = (
                [f"{k} {was[s].get(k)} → {v}" for k, v in now[s].items() if was[s].get(k) != v]
                if was.get(s)
                else ["not recorded"]
            )
            changes.append(f"{s}: {', '.join(diff)}")
    return "; ".join(changes)


def complete_sections(old, now, bundle):
    """The sections of a step's earlier results (old) that --skip-done keeps: those measured with the settings `now`
    and whole: CORE finished on every task the bundle holds (none while no bundle can be had), bpb, samples, the
    MoD curve. Decided by what the results hold, never by which files exist."""
    was = old.get("measured_with") or {}
    same = [s for s in ("bpb", "sample", "mod") if HAS_RESULTS[s](old) and was.get(s) == now[s]]
    if (
        bundle is not None
        and old.get("core_finished") is True
        and was.get("core") == now["core"]
        and set(old.get("tasks") or {}) == set(scorable_tasks(bundle))
    ):
        same.append("core")
    return same


def unfinished_core(run_dir, old, args, bundle, folder=EVAL_DIR):
    """The earlier CORE run of this step to resume (evaluate_core's `done`): one that stopped before its last task,
    with the same --max-per-task and bundle; else None (and a note when its settings differ). folder: where the
    record's files are (eval/, or eval/pending/ for one staged beside a complete result)."""
    if old.get("core_finished") is not False or not old.get("tasks"):
        return None
    if old.get("max_per_task") != args.max_per_task or old.get("eval_bundle") != bundle:
        print0(
            f"note: the interrupted CORE evaluation of step {old['step']} used --max-per-task "
            f"{old.get('max_per_task')} and the bundle {old.get('eval_bundle')}; this one starts over"
        )
        return None
    try:
        cols, settings = load_records(os.path.join(run_dir, folder, os.path.basename(old.get("core_records") or "")))
    except UserError:
        return None
    if settings.get("max_per_task") != args.max_per_task:
        return None
    print0(
        f"resuming the interrupted CORE evaluation of step {old['step']}: {len(old['tasks'])} task(s) already scored"
    )
    return {"tasks": old["tasks"], "records": records_by_task(cols), "settings": settings}


def print_table(record, now):
    """The step's CORE table and bpb; now: the sections measured by this command. Results kept from an earlier
    evaluation (a section not run now, CORE that could not be had) say so, never read as this command's."""
    lines = []
    earlier = "  (kept from an earlier evaluation)"
    if record["tasks"]:
        if "core" not in now:
            lines.append(f"CORE of an earlier evaluation of step {record['step']}, not measured now:")
        lines.append(f"{'task':<34} {'accuracy':>9} {'centred':>9}")
        for label, r in record["tasks"].items():
            lines.append(f"{label:<34} {r['accuracy']:>9.4f} {r['centered']:>+9.4f}")
        for label in record["missing_tasks"] or []:
            lines.append(f"{label:<34} {'missing':>9} {'':>9}")
        for label in record["interrupted_tasks"] or []:
            lines.append(f"{label:<34} {'not run':>9} {'':>9}")
        if record["core_metric"] is not None:
            lines.append(f"{'CORE':<34} {'':>9} {record['core_metric']:>9.4f}" + ("" if "core" in now else earlier))
        else:  # fewer than 22 tasks: never call it CORE
            lines.append(
                f"{record['partial_label']:<34} {'':>9} {record['partial_core']:>9.4f}"
                + ("  (interrupted: rerun to finish)" if record["interrupted"] else "")
                + ("" if "core" in now else earlier)
            )
    elif record["core_error"]:
        lines.append(f"CORE not evaluated: {record['core_error']}")
    for key in ("val_bpb", "train_bpb"):
        if record[key] is not None:
            lines.append(f"{key.replace('_', ' '):<34} {record[key]:>9.4f}" + ("" if "bpb" in now else earlier))
    print0("\n".join(lines))


def check_writable(run_dir, step=None):
    """Every output of base_eval can be written (a temp file in run_dir and in eval/, renamed over each): checked
    before any work, so that no evaluation is thrown away at the end. With a step, that step's files too."""
    for d in (run_dir, os.path.join(run_dir, EVAL_DIR)):
        if d != run_dir and not os.path.exists(d):
            continue  # made at the first write, in a directory just proven writable
        try:
            fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-write-check-")
            os.close(fd)
            os.remove(tmp)
        except OSError as e:
            raise UserError(f"cannot write into {d} ({e.strerror}); base_eval writes its results there") from None
    for name in list(TOP.values()) + (list(step_files(step).values()) if step is not None else []):
        path = os.path.join(run_dir, name)
        if os.path.isdir(path):
            raise UserError(f"cannot write {path}: it is a directory; move it away and retry")


@contextlib.contextmanager
def disk_errors(run_dir, step):
    """A write of the results that fails (a full disk) as one line: every file is written whole (atomically), so the
    step's earlier results and those saved so far stay as they were."""
    try:
        yield
    except OSError as e:
        raise UserError(
            f"cannot write the results of step {step} into {run_dir} ({e.strerror or e}): every file there is whole, "
            "the results saved so far kept; free space and run the command again"
        ) from None


def broadcast(obj):
    """rank 0's obj on every rank: what it read from the run directory decides what every rank does."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def evaluate(args):
    evals = parse_evals(args.eval)
    if args.mod_rate:
        parse_rates(args.mod_rate)
    device_type = args.device_type or autodetect_device_type()
    is_ddp, rank, _, world_size, device = dist_init(device_type)
    run_dir = resolve_run_dir(args.run)
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
        raise UserError(
            f"--mod-rate: {run_dir} holds a {meta['arch']!r} checkpoint, which has no router to score tokens by "
            "(train the router-MoD baseline with --arch gpt-router, or use a NAG checkpoint)"
        )
    model.set_compute_dtype(compute_dtype_for(device_type))
    attn_kernel, attn_reason = resolve_attention(args.attn, device, compute_dtype_for(device_type))
    model.set_attention(attn_kernel)
    if "tokens" in meta:  # NAG's alpha warm-up is a function of tokens seen: evaluate the model as it was trained
        model.set_tokens_seen(meta["tokens"])
    step = meta["step"]
    print0(
        f"evaluating {run_dir} step {step} ({meta['arch']}) on {device_type} × {world_size}: "
        f"{', '.join(e for e in EVALS if e in evals)}"
    )

    bundle, core_error = find_bundle(args.eval_bundle) if "core" in evals else (None, None)

    fingerprints = current_fingerprints(tokenizer)
    trained = meta.get("fingerprints") or {}
    other_data = [
        k[5:]
        for k in ("data_train", "data_val")
        if trained.get(k) and fingerprints[k] and trained[k] != fingerprints[k]
    ]
    if other_data:  # allowed (evaluating on other data is a choice), never silent
        print0(
            f"note: the {' and '.join(other_data)} data in the base dir differ from those this checkpoint was trained "
            "with; the results record both fingerprints"
        )
    check_writable(run_dir, step)  # on every rank, so that all of them stop
    measured = measured_with(args, bundle, world_size)
    old, kept = {}, []
    if rank == 0:
        # an eval.json of an earlier version (no eval/ file of its step) is one line, never overwritten
        check_layout(run_dir, read_record(os.path.join(run_dir, TOP["json"])))
        old = previous_results(run_dir, step, fingerprints)
        kept = complete_sections(old, measured, bundle) if args.skip_done else []
    old, kept = broadcast((old, kept))
    wanted = [s for s in ("bpb", "core", "sample") if s in evals] + ["mod"] * bool(args.mod_rate)
    kept = [s for s in wanted if s in kept]
    if kept:
        print0(f"kept from an earlier evaluation of step {step} with these settings (--skip-done): {', '.join(kept)}")
    run_core = bundle is not None and "core" in wanted and "core" not in kept
    sections = [s for s in wanted if s not in kept and (s != "core" or run_core)]
    # CORE that cannot be had now: the reason is recorded, unless earlier CORE results of the step are kept (or it is)
    earlier_core = HAS_RESULTS["core"](old)
    record_error = core_error is not None and not earlier_core and old.get("core_error") != core_error
    if core_error:
        print0(
            f"CORE skipped: {core_error}"
            + (f"; the CORE results of step {step} shown below are from an earlier evaluation" if earlier_core else "")
        )
    done, staged, changed = None, False, ""
    if rank == 0:
        changed = changed_settings(old, measured, sections)
        if run_core and old.get("core_finished") is False:  # an interrupted CORE run in place
            done = unfinished_core(run_dir, old, args, bundle)
        elif run_core:  # one staged beside a complete result
            done = unfinished_core(run_dir, read_pending(run_dir, step, fingerprints), args, bundle, PENDING)
        # earlier results are replaced only by complete ones: the new files wait in eval/pending/ until the end,
        # unless this continues an interrupted CORE run in place with the same settings
        staged = bool(old) and not (done is not None and old.get("core_finished") is False and not changed)
    done = broadcast(done)  # every rank resumes CORE at the same task
    record = {
        "run": os.path.basename(os.path.normpath(run_dir)),
        "step": step,
        "arch": meta["arch"],
        "tokens": meta.get("tokens"),
        "fingerprints": {
            k: v if v is not None else (old.get("fingerprints") or {}).get(k) for k, v in fingerprints.items()
        },
        "checkpoint_fingerprints": meta.get("fingerprints"),
        "world_size": world_size,
        "attention": {"requested": args.attn, "kernel": attn_kernel, "reason": attn_reason},
        "measured_with": dict(old.get("measured_with") or {}),
    }
    for fields in SECTION_FIELDS.values():
        record.update({k: old.get(k, default) for k, default in fields.items()})
    if not sections and not record_error:  # nothing to measure or record now: the files stay as they are
        if rank == 0:
            print_table(record, now=())
            print0(f"nothing measured now: {os.path.join(run_dir, step_files(step)['json'])} is unchanged")
        return record

    def save(results, records=None, settings=None, section=None):
        """Merge results into the record and write it (rank 0); CORE records go next to it, with the settings."""
        record.update(results)
        if section is not None:
            record["measured_with"][section] = measured[section]
        if rank == 0:
            with disk_errors(run_dir, step):
                write_results(run_dir, record, records, settings, pending=staged)

    if "bpb" in sections:
        save(eval_bpb(model, tokenizer, get_token_bytes(device=device), args, device, rank, world_size), section="bpb")
    if run_core:
        eval_core(
            model,
            tokenizer,
            device,
            bundle,
            args,
            lambda *a: save(*a, section="core"),
            step_files(step)["records"],
            done,
        )
    elif record_error:
        save({"core_error": core_error})
    if "sample" in sections:
        save(eval_samples(model, tokenizer, args.sample_tokens) if rank == 0 else {}, section="sample")
    if "mod" in sections:  # last: it reconfigures the model's MoD
        save(
            eval_mod_curve(model, tokenizer, get_token_bytes(device=device), args, device, rank, world_size, bundle),
            section="mod",
        )
    if rank == 0 and staged:  # finished: now it may replace the earlier results
        with disk_errors(run_dir, step):
            commit_pending(run_dir, record, with_records=run_core, replaced_why=changed)
    if rank == 0:
        print_table(record, now=sections)
        top = "" if step < max(evaluated_steps(run_dir)) else f" (and {TOP['json']}, the highest step evaluated)"
        print0(f"wrote {os.path.join(run_dir, step_files(step)['json'])}{top}")
    return record


@contextlib.contextmanager
def sigterm_as_interrupt():
    """SIGTERM (torchrun stopping its workers, a job scheduler, `kill`) ends base_eval like Ctrl-C: one line, exit
    status 130, the CORE tasks finished so far kept for a rerun to resume from."""

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread: signals stay as they are
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv=None):
    args = parse_checked(build_parser(), script_argv(argv))
    with (
        exit_on_user_error(
            interrupted="interrupted: the results saved so far are kept (CORE after every task, marked "
            "interrupted; in eval/pending/ where the step has earlier results, which stay as they were); "
            "the same command resumes CORE at the first unfinished task"
        ),
        sigterm_as_interrupt(),
    ):
        return evaluate(args)


if __name__ == "__main__":
    main()
