"""
Pretrain a base model: the GPT baseline (--arch gpt) or NAG (--arch nag); nag/archs.py lists the archs.

    python -m scripts.base_train --depth 2 --max-seq-len 64 --device-batch-size 4 --total-batch-size 256 --num-iterations 20 --eval-every 10 --eval-tokens 1024
    python -m scripts.base_train --preset published --arch nag --dry-run 8        # the plan only; no data, no GPU
    torchrun --nproc_per_node=8 -m scripts.base_train -- --preset published --arch nag --resume latest   (GPU)

Writes $NANOCHAT_BASE_DIR/runs/<run>/: config.json, metrics.jsonl, checkpoints (docs/runs.md).
`--resume latest` continues from the newest complete checkpoint, starts a run that has none,
and does nothing for a finished run.
"""

import os
import gc
import sys
import json
import math
import argparse
import contextlib
import subprocess
from dataclasses import dataclass

# The CUDA caching allocator reads its settings once, no later than its first allocation, so they are set here, before
# torch is even imported: the earliest point of a training process's start-up (python -m scripts.base_train, what
# torchrun starts; a module that merely imports this one keeps its environment). Expandable segments let a block of
# memory grow in place instead of reserving new fixed-size ones, so the varying sizes of a run (evaluation batches,
# the optimizer's temporaries) do not fragment memory into reserved but unusable pieces. A user's own setting, under
# either name torch reads, wins; without CUDA nothing reads it.
if __name__ == "__main__" and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ and "PYTORCH_ALLOC_CONF" not in os.environ:
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"

import torch
import torch.distributed as dist

from nanochat.common import UserError, exit_on_user_error, print0, dist_init, autodetect_device_type, compute_dtype_for, atomic_write_json, atomic_write_bytes, ensure_writable_dir, script_argv, START_TIMEOUT
from nanochat.distributed import EXIT_PREEMPTED, StopRequest, Watchdog, check_shared_dir, rank0_decides
from nanochat.flash_attention import CHOICES as ATTN_CHOICES, resolve_attention
from nanochat.step_timer import StepTimer, Readback, biggest
from nanochat.gpt import GPTConfig
from nanochat.tokenizer import get_tokenizer, get_token_bytes
from nanochat.dataloader import data_loader
from nanochat.loss_eval import evaluate_bpb_shared, held_batches, shared_batches
from nanochat.optim import MuonAdamW, POLAR_NORM_FACTOR, NORMUON_BETA2
from nanochat import checkpoint_manager as ckpt
from nanochat import tracking
from nag.archs import ARCHS, arch_for_args
from nag.presets import PRESETS, preset_args

REFERENCE_BATCH = 2 ** 19  # tokens; the d12 reference of the muP-style batch rules
REFERENCE_DEPTH = 12
BATCH_EXPONENT = 0.383
MAX_DECAY_PER_STEP = 0.01
SAVES_PER_RUN = 5  # --save-every auto: about this many checkpoints before the last one
MOMENTUM = {"start": 0.85, "peak": 0.97, "peak_step": 400, "end": 0.90}  # Muon momentum schedule of the published code
PREFETCH = True  # fetch each micro-batch while the device works on the one before; False only to test that it changes nothing


def build_parser():
    p = argparse.ArgumentParser(description="Pretrain a GPT or NAG base model.")
    p.add_argument("--preset", type=str, default="", help=f"a named configuration ({', '.join(PRESETS)}; nag/presets.py); later flags override it")
    p.add_argument("--run", type=str, default=None, help="run name (one directory under $NANOCHAT_BASE_DIR/runs) or a directory path; default <arch>-d<depth>")
    p.add_argument("--arch", type=str, default="gpt", help=f"one of {', '.join(ARCHS)}")
    p.add_argument("--device-type", type=str, default="", help="cuda|cpu|mps (default: autodetect)")
    p.add_argument("--seed", type=int, default=42, help="seed of the initialisation")
    p.add_argument("--data-seed", type=int, default=None,
                   help="seed of the order the train documents are read in (row groups shuffled per epoch; default: file order)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None, help="torch.compile the model (default: on for cuda)")
    p.add_argument("--attn", type=str, default="auto", choices=list(ATTN_CHOICES),
                   help="attention kernel: auto = FlashAttention-3 on Hopper when its hub kernel loads (pip install kernels), else SDPA")
    # model
    p.add_argument("--depth", type=int, default=20)
    p.add_argument("--aspect-ratio", type=int, default=64, help="model dim = depth × aspect ratio, rounded up to a multiple of head dim")
    p.add_argument("--model-dim", type=int, default=-1, help="explicit model dim (overrides --aspect-ratio)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--n-kv-head", type=int, default=-1, help="GQA key/value heads (default: = query heads)")
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--window-pattern", type=str, default="L", help="per-layer attention windows, cycled: L full, S half")
    # horizon (first of these that is set wins)
    p.add_argument("--num-iterations", type=int, default=-1)
    p.add_argument("--target-flops", type=float, default=-1.0)
    p.add_argument("--target-param-data-ratio", type=float, default=10.5)
    # batch
    p.add_argument("--device-batch-size", type=int, default=32)
    p.add_argument("--total-batch-size", type=int, default=-1, help="tokens per optimizer step (default: auto from the model size)")
    # optimization
    p.add_argument("--embedding-lr", type=float, default=0.3)
    p.add_argument("--unembedding-lr", type=float, default=0.004)
    p.add_argument("--matrix-lr", type=float, default=0.02)
    p.add_argument("--weight-decay", type=float, default=0.28, help="Muon weight decay at the d12 reference (scaled by √(B/2^19)·S_ref/S)")
    p.add_argument("--muon-momentum", type=float, default=-1.0, help="constant Muon momentum (default: 0.85→0.97 ramp, 0.90 in warm-down)")
    p.add_argument("--warmup-steps", type=int, default=40, help="LR warm-up; capped so it ends before the warm-down starts")
    p.add_argument("--warmdown-ratio", type=float, default=0.65)
    p.add_argument("--final-lr-frac", type=float, default=0.05)
    # evaluation and checkpoints
    p.add_argument("--eval-every", type=int, default=250, help="val bpb every N steps and at the end; -1 = never")
    p.add_argument("--eval-tokens", type=int, default=10 * 2 ** 19, help="val tokens per evaluation (capped at what the split holds)")
    p.add_argument("--save-every", type=int, default=-1, help=f"checkpoint every N steps (-1: auto, ~{SAVES_PER_RUN} per run; 0: the last step only)")
    p.add_argument("--log-every", type=int, default=1, metavar="N",
                   help="a metrics row and a training line every N steps (and at evaluations, saves and the end); "
                        "the steps between read nothing from the device")
    p.add_argument("--log-to", type=str, default="", metavar="KINDS",
                   help="also send every metrics row to tensorboard, wandb and/or trackio, comma-separated (the [track] extra; docs/interop.md §5)")
    p.add_argument("--resume", type=str, default="", help="'latest' (newest complete checkpoint; starts the run if it has none) or a step")
    p.add_argument("--change-horizon", action="store_true", help="with --resume: allow a different number of steps than the run was planned with")
    p.add_argument("--change-settings", action="store_true",
                   help="with --resume: accept settings that differ from the run's, recorded in config.json's segments from this step on")
    p.add_argument("--keep-checkpoints", type=int, default=0, metavar="K",
                   help="after each save, delete all but the newest K complete checkpoints (0: keep every one)")
    # several processes: how long a rank may wait for the others before the run stops, naming the silent ranks
    p.add_argument("--step-timeout", type=float, default=300, help="seconds a training step may take once training runs")
    p.add_argument("--start-timeout", type=float, default=START_TIMEOUT,
                   help="seconds for start-up (data, compile, the first step), evaluations and checkpoint saves")
    p.add_argument("--dry-run", type=int, default=0, metavar="NPROC",
                   help="print the plan for NPROC processes (params, FLOPs, steps, tokens, optimizer) and exit; needs no data or GPU")
    p.add_argument("--dry-run-vocab", type=int, default=32768, help="vocab size assumed by --dry-run (0 = the trained tokenizer's)")
    for add_args in dict.fromkeys(cls.add_args for cls in ARCHS.values()):  # subclasses may share their parent's flags
        add_args(p)
    return p


def parse_args(argv=None):
    """Flags of a --preset first, then the command line, so that later flags win."""
    argv = script_argv(argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--preset", default="")
    pre.add_argument("--arch", default="gpt")
    known, _ = pre.parse_known_args(argv)
    return build_parser().parse_args(preset_args(known.preset, known.arch) + argv)


# ---------------------------------------------------------------------------
# checked flags


def validate_args(args):
    """Every value that would crash later or train silently wrong, refused up front in one line."""
    tracking.parse_log_to(args.log_to)  # an unknown tracker or a missing package, before anything starts
    positive = {"--depth": args.depth, "--head-dim": args.head_dim, "--max-seq-len": args.max_seq_len,
                "--device-batch-size": args.device_batch_size, "--aspect-ratio": args.aspect_ratio,
                "--matrix-lr": args.matrix_lr, "--embedding-lr": args.embedding_lr, "--unembedding-lr": args.unembedding_lr}
    for flag, v in positive.items():
        if not v > 0:
            raise UserError(f"{flag} must be positive (got {v})")
    for flag, v in {"--target-flops": args.target_flops, "--target-param-data-ratio": args.target_param_data_ratio}.items():
        if not math.isfinite(v):  # a value <= 0 means unset
            raise UserError(f"{flag} must be a finite number (got {v}); use -1 to leave it unset")
    if not set(args.window_pattern) <= {"L", "S"} or not args.window_pattern:
        raise UserError(f"--window-pattern takes the letters L (full context) and S (half), got {args.window_pattern!r}")
    if not 0 <= args.final_lr_frac <= 1:
        raise UserError(f"--final-lr-frac must be in [0, 1] (got {args.final_lr_frac})")
    if not 0 <= args.warmdown_ratio <= 1:
        raise UserError(f"--warmdown-ratio must be in [0, 1] (got {args.warmdown_ratio})")
    if args.warmup_steps < 0 or args.weight_decay < 0:
        raise UserError("--warmup-steps and --weight-decay must be >= 0")
    if args.muon_momentum != -1 and not 0 <= args.muon_momentum < 1:
        raise UserError(f"--muon-momentum must be in [0, 1), or -1 for the schedule (got {args.muon_momentum})")
    if args.log_every < 1:
        raise UserError(f"--log-every must be >= 1 (1 logs every step), got {args.log_every}")
    if args.keep_checkpoints < 0:
        raise UserError(f"--keep-checkpoints must be >= 0 (0 keeps every checkpoint), got {args.keep_checkpoints}")
    if not (args.step_timeout > 0 and args.start_timeout > 0):
        raise UserError(f"--step-timeout and --start-timeout must be positive seconds (got {args.step_timeout:g}, {args.start_timeout:g})")
    if args.eval_tokens < 1:
        raise UserError(f"--eval-tokens must be positive (got {args.eval_tokens})")
    if args.resume not in ("", "latest") and not args.resume.isdigit():
        raise UserError(f"--resume takes 'latest' or a step number, got {args.resume!r}")
    if (args.change_horizon or args.change_settings) and not args.resume:
        raise UserError(f"--change-{'horizon' if args.change_horizon else 'settings'} only applies with --resume")
    if args.device_type not in ("", "cpu", "cuda", "mps"):
        raise UserError(f"--device-type must be cpu, cuda or mps (got {args.device_type!r})")
    if args.run is not None and args.run.strip() in ("", ".", ".."):
        raise UserError(f"{args.run!r} is not a run name; give a name like gpt-d20, or leave --run out for <arch>-d<depth>")
    if args.device_type == "cuda" and not torch.cuda.is_available() and not args.dry_run:
        raise UserError("--device-type cuda, but torch sees no CUDA device here (use --device-type cpu, or a CUDA build of torch)")
    arch_for_args(args)


def ignored_nag_flags(args):
    """NAG flags set on another arch. Not an error: speedrun.sh passes one flag list to both runs of a pair;
    but never silent either."""
    if args.arch == "nag":
        return []
    defaults = build_parser().parse_args([])
    return [f"--{k.replace('_', '-')}" for k, v in vars(args).items() if k.startswith("nag_") and v != getattr(defaults, k)]


def model_config_from_args(args, vocab_size, depth=None):
    depth = depth or args.depth
    if args.model_dim > 0:
        dim = args.model_dim
    else:
        dim = args.depth * args.aspect_ratio
        dim = -(-dim // args.head_dim) * args.head_dim
    if dim % args.head_dim:
        raise UserError(f"model dim {dim} is not a multiple of --head-dim {args.head_dim}")
    n_head = dim // args.head_dim
    n_kv = n_head if args.n_kv_head <= 0 else args.n_kv_head
    if n_head % n_kv:
        raise UserError(f"--n-kv-head {n_kv} must divide the number of heads {n_head}")
    if (dim // n_head) % 2:
        raise UserError(f"head dim {dim // n_head} must be even (rotary embeddings rotate pairs)")
    return GPTConfig(sequence_len=args.max_seq_len, vocab_size=vocab_size, n_layer=depth, n_head=n_head,
                     n_kv_head=n_kv, n_embd=dim, window_pattern=args.window_pattern)


# ---------------------------------------------------------------------------
# the plan: everything derived from the flags, shared by --dry-run and training


@dataclass
class Plan:
    run: str
    arch: str
    config: GPTConfig
    model: torch.nn.Module  # on the meta device: nothing allocated
    nproc: int
    total_batch: int
    grad_accum: int
    num_iterations: int
    lr_scale: float
    weight_decay: float
    warmup_steps: int
    warmdown_steps: int
    final_lr_frac: float
    save_every: int
    flops_per_token: int

    def optimizer_groups(self, args):
        return self.model.optimizer_groups(args.embedding_lr, args.unembedding_lr, args.matrix_lr, self.weight_decay,
                                           self.lr_scale, **type(self.model).optimizer_kwargs_from_args(args))

    def optimizer_record(self, args):
        """Every optimizer group's settings at step 0 and the schedules applied to them."""
        lrm0 = lr_multiplier(0, self)
        groups = []
        for g in MuonAdamW(self.optimizer_groups(args)).param_groups:
            row = {"name": g["name"], "kind": g["kind"], "num_params": sum(p.numel() for p in g["params"]), "lr": g["lr"],
                   "lr_at_step0": g["lr"] * lrm0, "weight_decay": g["weight_decay"]}
            if g["kind"] == "adamw":
                row.update(betas=list(g["betas"]), eps=g["eps"])
            else:
                row.update(momentum_at_step0=momentum_at(0, self, args), normuon_beta2=g["beta2"])
            groups.append(row)
        momentum = ({"constant": args.muon_momentum} if args.muon_momentum > 0 else
                    dict(MOMENTUM, end_step=self.num_iterations, warmdown_start_step=self.num_iterations - self.warmdown_steps))
        return {"groups": groups, "muon_momentum": momentum,
                "muon_weight_decay": {"value": self.weight_decay, "rule": "weight_decay × √(B/2^19) × S_ref/S (capped at lr × wd ≤ 0.01)",
                                      "schedule": "cosine from value to 0 over the run"},
                "adamw_weight_decay": "constant", "polar_norm_factor": POLAR_NORM_FACTOR, "normuon_beta2": NORMUON_BETA2,
                "lr_schedule": {"warmup_steps": self.warmup_steps, "warmdown_steps": self.warmdown_steps,
                                "final_lr_frac": args.final_lr_frac}}

    def record(self, args):
        """The plan as plain JSON: the PLAN line of --dry-run and the body of config.json."""
        params = sum(p.numel() for p in self.model.parameters())
        return {"run": self.run, "arch": self.arch, "model_config": self.config.to_dict(), **self.model.extra_meta(),
                "num_params": params, "num_scaling_params": self.model.num_scaling_params(),
                "flops_per_token": self.flops_per_token, "num_iterations": self.num_iterations,
                "total_batch_size": self.total_batch, "grad_accum_steps": self.grad_accum, "world_size": self.nproc,
                "total_tokens": self.num_iterations * self.total_batch,
                "total_flops": self.flops_per_token * self.num_iterations * self.total_batch,
                "lr_scale": self.lr_scale, "weight_decay_effective": self.weight_decay, "save_every": self.save_every,
                "seed": args.seed, "data_seed": args.data_seed,  # null: the train data in file order
                "optimizer": self.optimizer_record(args),
                # fp32 weights + optimizer state (AdamW: 2 fp32 moments; Muon: 1 momentum + small variance) ≈ 12-16 bytes/param
                "checkpoint_gib": params * 16 / 2 ** 30}


def make_plan(args, vocab_size, nproc):
    validate_args(args)
    arch, cls = arch_for_args(args)
    init_kwargs = cls.init_kwargs_from_args(args)
    config = model_config_from_args(args, vocab_size)
    with torch.device("meta"):
        model = cls(config, **init_kwargs)
        # the reference of the batch and weight-decay rules: the d12 model of the same width and arch
        reference = cls(model_config_from_args(args, vocab_size, depth=REFERENCE_DEPTH), **init_kwargs)
    size_ratio = model.num_scaling_params() / reference.num_scaling_params()  # S / S_ref
    flops_per_token = model.estimate_flops()
    world_tokens = args.device_batch_size * args.max_seq_len * nproc
    batch = args.total_batch_size
    if batch <= 0:
        batch = 2 ** round(math.log2(REFERENCE_BATCH * size_ratio ** BATCH_EXPONENT))
        batch = max(1, round(batch / world_tokens)) * world_tokens  # whole micro-batches on every process
    if batch % world_tokens:
        raise UserError(f"--total-batch-size {batch} is not a multiple of device batch × seq len × processes = {world_tokens}")
    if args.num_iterations > 0:
        steps = args.num_iterations
    elif args.target_flops > 0:
        steps = round(args.target_flops / (flops_per_token * batch))
    elif args.target_param_data_ratio > 0:
        steps = round(args.target_param_data_ratio * model.num_scaling_params() / batch)
    else:
        raise UserError("set one of --num-iterations, --target-flops, --target-param-data-ratio")
    if steps < 1:
        raise UserError(f"the budget gives {steps} steps at {batch} tokens per step; raise the budget or lower the batch")
    lr_scale = math.sqrt(batch / REFERENCE_BATCH)
    weight_decay = args.weight_decay * lr_scale / size_ratio
    # far below the reference size the rule explodes (S_ref/S ~ 1e3 on a CPU demo): never shrink
    # the matrices by more than MAX_DECAY_PER_STEP in one step
    max_wd = MAX_DECAY_PER_STEP / (args.matrix_lr * lr_scale)
    if weight_decay > max_wd:
        print0(f"note: the weight-decay rule gives {weight_decay:.3g} for this small model; capped to {max_wd:.3g} "
               f"(lr × wd ≤ {MAX_DECAY_PER_STEP} per step)")
        weight_decay = max_wd
    # warm-up and warm-down never overlap: the warm-up is cut to the steps before the warm-down
    warmdown = round(args.warmdown_ratio * steps)
    warmup = min(args.warmup_steps, steps - warmdown)
    save_every = args.save_every if args.save_every >= 0 else math.ceil(steps / SAVES_PER_RUN)
    return Plan(run=args.run or f"{arch}-d{args.depth}", arch=arch, config=config, model=model, nproc=nproc,
                total_batch=batch, grad_accum=batch // world_tokens, num_iterations=steps, lr_scale=lr_scale,
                weight_decay=weight_decay, warmup_steps=warmup, warmdown_steps=warmdown, final_lr_frac=args.final_lr_frac, save_every=save_every,
                flops_per_token=flops_per_token)


def lr_multiplier(step, plan):
    """Linear warm-up to 1, constant, then linear warm-down to final_lr_frac over the last warmdown_steps."""
    final = plan.final_lr_frac
    n, warmdown = plan.num_iterations, plan.warmdown_steps
    if step < plan.warmup_steps:
        return (step + 1) / plan.warmup_steps
    if step <= n - warmdown:
        return 1.0
    progress = (n - step) / warmdown
    return progress + (1 - progress) * final


def muon_momentum(step, num_iterations, warmdown_steps):
    """0.85 → 0.97 over the first 400 steps, then linearly to 0.90 across the warm-down."""
    frac = min(step / MOMENTUM["peak_step"], 1.0)
    m = (1 - frac) * MOMENTUM["start"] + frac * MOMENTUM["peak"]
    start = num_iterations - warmdown_steps
    if warmdown_steps > 0 and step > start:
        p = (step - start) / warmdown_steps
        m = (1 - p) * m + p * MOMENTUM["end"]
    return m


def momentum_at(step, plan, args):
    return args.muon_momentum if args.muon_momentum > 0 else muon_momentum(step, plan.num_iterations, plan.warmdown_steps)


def git_commit():
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here, capture_output=True, text=True, timeout=10).stdout.strip()
        return (sha + ("-dirty" if dirty else "")) or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "A100": 312e12, "B200": 2250e12}


def peak_flops(device_type):
    if device_type != "cuda":
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)


def fmt_time(s):
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def dry_run(args):
    """The plan of a run, computed on the meta device: nothing is allocated, no data is read."""
    plan = make_plan(args, args.dry_run_vocab or get_tokenizer().get_vocab_size(), args.dry_run)
    record = plan.record(args)
    print(f"PLAN {json.dumps(record)}")
    c = plan.config
    print(f"{plan.run}: {plan.arch} d{c.n_layer} dim {c.n_embd} | {record['num_params']:,} params | {plan.flops_per_token:,} FLOPs/token | "
          f"{plan.num_iterations:,} steps × {plan.total_batch:,} tokens = {record['total_tokens']:,} tokens | {record['total_flops']:.4g} FLOPs | "
          f"grad accum {plan.grad_accum} on {plan.nproc} process(es) | warm-up {plan.warmup_steps}, warm-down {plan.warmdown_steps} steps | "
          f"checkpoint every {plan.save_every or plan.num_iterations} steps | seed {args.seed}, "
          f"data seed {'none (file order)' if args.data_seed is None else args.data_seed}")
    return record


def eval_batches(tokenizer, args):
    """Val batches per evaluation: --eval-tokens worth, capped at what the val split holds (a small split
    would otherwise be cycled over many times). Counted on the whole split, as one process would read it:
    the ranks share these batches (nanochat/loss_eval.py), so val bpb does not depend on their number."""
    batch_tokens = args.device_batch_size * args.max_seq_len
    wanted = max(1, args.eval_tokens // batch_tokens)
    steps = max(1, held_batches(tokenizer, args.device_batch_size, args.max_seq_len, "val", wanted))
    if steps < wanted:
        print0(f"note: the val split holds about {steps * batch_tokens:,} tokens, fewer than --eval-tokens "
               f"{args.eval_tokens:,}; each evaluation uses those")
    return steps


# ---------------------------------------------------------------------------
# safety


class NonFiniteError(Exception):
    pass


def finite_flags(model, loss):
    """1 where finite, 0 where not: the loss, then the gradient of each parameter that has one (in model.parameters()
    order, as graded_names), computed on the device: no host sync."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norms = torch.stack(torch._foreach_norm(grads)).to(loss.dtype) if grads else loss.new_zeros(0)
    return torch.cat([loss.reshape(1), norms]).isfinite().to(loss.dtype)


def graded_names(model):
    return [n for n, p in model.named_parameters() if p.grad is not None]


def nonfinite_message(step, loss, bad):
    shown = ", ".join(bad[:12]) + (f" (+{len(bad) - 12} more)" if len(bad) > 12 else "")
    return (f"non-finite {'loss' if not math.isfinite(loss) else 'gradient'} at step {step} (loss {loss:.4g}); "
            f"non-finite gradients in: {shown or 'none'}")


def check_finite(model, loss, step, idx):
    """Stop on a non-finite loss or gradient, naming the step, the offending parameters and, where the model
    can tell (model.nonfinite_origin over idx, the last micro-batch), where it started."""
    if finite_flags(model, loss).all().item():  # one host sync
        return
    bad = [n for n, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
    origin = model.nonfinite_origin(idx)
    raise NonFiniteError(nonfinite_message(step, loss.item(), bad) + (f"; origin: {origin}" if origin else ""))


def check_finite_late(values, step, names, log_every):
    """check_finite for a step that logged no row, from its finite_flags read during the next step (Readback): the
    weights have taken that step's update by now, so no origin is sought; no checkpoint holds them (saves log)."""
    loss, flags = values[0], values[1:]
    if all(flags):
        return
    bad = [n for n, ok in zip(names, flags[1:]) if not ok]
    raise NonFiniteError(nonfinite_message(step, loss, bad) + f"; seen during step {step + 1} (with --log-every {log_every} a "
                         "step that logs no row is checked during the next); --log-every 1 from the last checkpoint names its origin")


# ---------------------------------------------------------------------------
# the run directory: where to start, and the history kept across restarts

# what must match for a resume. The process count may change: the train data is cut into world_size × grad_accum
# shards, a number fixed by the total and device batch sizes, and each shard's loader state moves to its new owner
RESUME_KEYS = ("arch", "model_config", "total_batch_size")


# flags that change no number a run trains: where and how often it reports and saves, how it is launched
NOT_SETTINGS = {"run", "resume", "dry_run", "dry_run_vocab", "change_horizon", "change_settings", "preset", "device_type", "compile", "attn",
                "eval_every", "eval_tokens", "save_every", "log_every", "log_to", "nag_gate_log_every", "nag_impl", "keep_checkpoints",
                "step_timeout", "start_timeout",
                "num_iterations", "target_flops", "target_param_data_ratio"}  # the horizon has its own check (--change-horizon)


def settings_changes(old_cfg, record):
    """{flag: (then, now)} for every setting that differs from the run's current one (model, optimizer, schedule, data)."""
    then, now = old_cfg.get("args", {}), record["args"]
    defaults = vars(build_parser().parse_args([]))
    then = {k: then.get(k, defaults.get(k)) for k in now}  # a flag newer than the run: it ran with the default
    return {f"--{k.replace('_', '-')}": (then[k], now[k]) for k in sorted(set(now) - NOT_SETTINGS) if then[k] != now[k]}


def settings_segments(old_cfg, record, start):
    """config.json's history of settings: one segment per start with other settings, oldest first, never rewritten."""
    segments = list(old_cfg.get("segments", [])) or [{"start_step": 0, "command": old_cfg.get("command", record["command"]),
                                                        "git_commit": old_cfg.get("git_commit", record["git_commit"])}]
    changes = {k: {"then": a, "now": b} for k, (a, b) in (settings_changes(old_cfg, record) if old_cfg else {}).items()}
    if old_cfg.get("world_size", record["world_size"]) != record["world_size"]:  # the same numbers (docs/runs.md), but say so
        changes["world_size"] = {"then": old_cfg["world_size"], "now": record["world_size"]}
    if start > 0 and (changes or old_cfg.get("git_commit") != record["git_commit"]):
        segments.append({"start_step": start, "command": record["command"], "git_commit": record["git_commit"], "changes": changes})
    return segments


def start_step(run_dir, args, record, tokenizer):
    """The step to start from, after every check that can refuse the command (nothing is written here).
    Returns None for a finished run resumed with --resume latest (nothing to do)."""
    complete = ckpt.complete_steps(run_dir) if os.path.isdir(run_dir) else []
    if not args.resume:
        if complete:
            raise UserError(f"{run_dir} already holds a run with checkpoints up to step {complete[-1]}; "
                            "continue it with --resume latest, or pick another --run")
        return 0
    if args.resume == "latest":
        if not complete:
            return 0
        step = ckpt.latest_step(run_dir)
    else:
        step = int(args.resume)
        if step not in complete:
            raise ckpt.missing_step_error(run_dir, step)
    ckpt.check_vocab(ckpt.load_meta(run_dir, step), tokenizer)
    cfg_path = os.path.join(run_dir, "config.json")
    old_cfg = json.load(open(cfg_path)) if os.path.exists(cfg_path) else {}
    for key in RESUME_KEYS:
        if key in old_cfg and old_cfg[key] != record.get(key):
            raise UserError(f"cannot resume {run_dir}: its {key} was {old_cfg[key]} but this command gives {record.get(key)}")
    for key, old in old_cfg.get("fingerprints", {}).items():
        if record["fingerprints"].get(key) != old:
            what = "tokenizer" if key == "tokenizer" else f"{key[5:]} data"
            raise UserError(f"cannot resume {run_dir}: its {what} changed (fingerprint {old} then, {record['fingerprints'].get(key)} now); "
                            "resume with the base dir it was trained in")
    changed = settings_changes(old_cfg, record)
    if changed and not args.change_settings:
        listed = "; ".join(f"{k} {a} → {b}" for k, (a, b) in changed.items())
        finished = step == old_cfg.get("num_iterations") and args.resume == "latest"
        raise UserError(f"cannot {'reuse the finished run' if finished else 'resume'} {run_dir} with other settings ({listed}): "
                        + ("pick another --run" if finished else "drop them, pick another --run, or add --change-settings to record the change from this step on"))
    shards = lambda cfg: cfg["world_size"] * cfg["grad_accum_steps"]
    if "grad_accum_steps" in old_cfg and shards(old_cfg) != shards(record):
        raise UserError(f"cannot resume {run_dir} on {record['world_size']} process(es) × {record['grad_accum_steps']} micro-step(s): its "
                        f"data was cut into {shards(old_cfg)} shards ({old_cfg['world_size']} × {old_cfg['grad_accum_steps']}), this "
                        f"command's --device-batch-size gives {shards(record)}; keep --device-batch-size {old_cfg.get('args', {}).get('device_batch_size', 'it had')}")
    planned = old_cfg.get("num_iterations", record["num_iterations"])
    if planned != record["num_iterations"] and not args.change_horizon:
        raise UserError(f"cannot resume {run_dir}: it was planned for {planned} steps but this command gives {record['num_iterations']} "
                        "(the LR schedule would change mid-run); add --change-horizon if that is what you want")
    if step > record["num_iterations"]:
        raise UserError(f"cannot resume {run_dir} from step {step}: the new horizon ends at step {record['num_iterations']}")
    if step == record["num_iterations"] and args.resume == "latest":
        return None
    return step


def read_metrics_rows(path):
    """metrics.jsonl as (step, line) pairs; a torn last line (what a kill mid-write leaves) is returned with step None."""
    if not os.path.exists(path):
        return []
    lines = [line for line in open(path) if line.strip()]
    rows = []
    for i, line in enumerate(lines):
        try:
            step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            if i < len(lines) - 1:
                raise UserError(f"{path} line {i + 1} is not a metrics row; fix or move the file away") from None
            step = None
        rows.append((step, line if line.endswith("\n") else line + "\n"))
    return rows


def keep_history(metrics_path, step):
    """Rows past the checkpoint we restart from (and a torn last line) move to metrics.jsonl.bak-<step>,
    appended, never deleted; metrics.jsonl then reads like an uninterrupted run up to that step."""
    rows = read_metrics_rows(metrics_path)
    last_kept = step if step > 0 else -1  # a fresh start writes its own step-0 row
    keep = [line for s, line in rows if s is not None and s <= last_kept]
    drop = [line for s, line in rows if s is None or s > last_kept]
    if not drop:
        return
    bak = f"{metrics_path}.bak-{step}"
    with open(bak, "a") as f:
        f.writelines(drop)
    atomic_write_bytes(metrics_path, "".join(keep).encode())
    print0(f"note: {len(drop)} earlier row(s) of metrics.jsonl {'past step ' + str(step) if step else ''} kept in {os.path.basename(bak)}")


# ---------------------------------------------------------------------------


def train(args, freeze_gc=False):
    """freeze_gc: collect and freeze the heap after the first step (train_locked says why). Only for a process that is
    this run alone (the command line, main()): a full collection walks a caller's whole heap too, seconds over a
    test session of in-process runs, and freezing keeps a caller's cyclic garbage until the run ends."""
    if args.dry_run:
        return dry_run(args)
    validate_args(args)
    if ignored := ignored_nag_flags(args):
        print0(f"note: {', '.join(ignored)} apply only with --arch nag; this {args.arch} run ignores them")
    preset = PRESETS.get(args.preset, {})
    if preset.get("gpu") and not args.device_type and not torch.cuda.is_available():
        raise UserError(f"--preset {args.preset} is a GPU configuration and torch {torch.__version__} sees no CUDA device here; "
                        f"see its plan with --dry-run N, or pass --device-type cpu to train it on the CPU anyway")
    device_type = args.device_type or autodetect_device_type()
    is_ddp, rank, local_rank, world_size, device = dist_init(device_type, timeout=args.start_timeout)
    is_master = rank == 0
    torch.manual_seed(args.seed)
    compute_dtype = compute_dtype_for(device_type)
    attn_kernel, attn_reason = resolve_attention(args.attn, device, compute_dtype)  # --attn fa3 where it cannot run: one line
    if device_type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    tokenizer = get_tokenizer()
    if preset.get("gpu") and tokenizer.get_vocab_size() != preset["vocab"]:  # its plan and published numbers assume that vocab
        raise UserError(f"--preset {args.preset} trains with a {preset['vocab']:,}-token tokenizer, but the one in the base dir has "
                        f"{tokenizer.get_vocab_size():,}; use a fresh NANOCHAT_BASE_DIR, or retrain it with scripts.tok_train --vocab-size {preset['vocab']}")
    token_bytes = get_token_bytes(device=device)
    plan = make_plan(args, tokenizer.get_vocab_size(), world_size)
    record = plan.record(args)
    record.update(args=vars(args), device_type=device_type, compute_dtype=str(compute_dtype).replace("torch.", ""),
                  git_commit=git_commit(), torch_version=torch.__version__, command=" ".join(sys.argv),
                  fingerprints=ckpt.fingerprints(tokenizer), attention={"requested": args.attn, "kernel": attn_kernel, "reason": attn_reason})
    run_dir = ckpt.resolve_run_dir(plan.run)
    with contextlib.ExitStack() as stack:
        def open_run_dir():  # rank 0 only; a refusal reaches every rank
            ensure_writable_dir(run_dir)
            stack.enter_context(ckpt.run_lock(run_dir))
            ckpt.remove_temp_files(run_dir)
        rank0_decides(open_run_dir, is_ddp)
        check_shared_dir(run_dir, is_ddp)
        stop = StopRequest()  # SIGTERM from here on: a checkpoint at the end of the current step, then EXIT_PREEMPTED
        stack.callback(stop.restore)
        if freeze_gc:
            stack.callback(gc.unfreeze)  # back to the collector's sight when training ends, however it ends
        return train_locked(args, plan, record, run_dir, tokenizer, token_bytes, device, device_type, compute_dtype,
                            is_ddp, rank, local_rank, world_size, stop, freeze_gc)


def load_resume_state(run_dir, step, rank, world_size, grad_accum, optimizer):
    """Load this rank's share of the train state saved at `step` into `optimizer` (each saved rank holds its rows of
    the sharded Muon state, rank 0 the AdamW state: ranks_to_load names the files this rank needs), and return the
    loader states of its data shards, the RNG state and the elapsed time. The data is cut into world_size × grad_accum
    shards whatever the split over processes (start_step checks the count), so a checkpoint of another process count
    resumes too: shard s was micro-step s % a of saved rank s // a, and is now that of rank s // grad_accum."""
    saved_world = ckpt.load_meta(run_dir, step).get("world_size", 1)
    saved_accum = world_size * grad_accum // saved_world
    mine = range(rank * grad_accum, (rank + 1) * grad_accum)
    optim_ranks = optimizer.ranks_to_load(saved_world)
    owners = sorted({s // saved_accum for s in mine} | {0} | set(optim_ranks))
    states = {r: ckpt.load_train_state(run_dir, step, r) for r in owners}  # on the CPU: RNG states must stay there
    optimizer.load_state_dicts({r: states[r]["optimizer"] for r in optim_ranks})  # moved to the params' device
    return {"elapsed": states[0].get("elapsed", 0.0), "rng": states[mine[0] // saved_accum]["rng"],
            "dataloader": [states[s // saved_accum]["dataloader"][s % saved_accum] for s in mine]}


def train_locked(args, plan, record, run_dir, tokenizer, token_bytes, device, device_type, compute_dtype,
                 is_ddp, rank, local_rank, world_size, stop, freeze_gc=False):
    is_master = rank == 0
    # one start step for all ranks: rank 0's view of the run directory decides
    first = rank0_decides(lambda: start_step(run_dir, args, record, tokenizer), is_ddp)
    if first is None:
        print0(f"{run_dir} already finished its {plan.num_iterations} steps; nothing to do")
        if is_ddp:
            dist.destroy_process_group()
        return run_dir
    model, num_iterations, total_batch, grad_accum = plan.model, plan.num_iterations, plan.total_batch, plan.grad_accum
    model.to_empty(device=device)
    model.init_weights()
    model.set_compute_dtype(compute_dtype)
    model.set_attention(record["attention"]["kernel"])  # before DDP and compile: the compiled graph sees a constant
    use_compile = args.compile if args.compile is not None else device_type == "cuda"
    # under DDP each rank updates its chunk of every Muon stack, then all-gathers them (docs/optimizer.md)
    optimizer = MuonAdamW(plan.optimizer_groups(args), rank=rank, world_size=world_size, compile=use_compile)

    loader_states, elapsed = None, 0.0
    if first > 0:
        ckpt.load_weights(model, ckpt.load_model_file(run_dir, first, device))
        state = load_resume_state(run_dir, first, rank, world_size, grad_accum, optimizer)
        loader_states, elapsed = state["dataloader"], state["elapsed"]
        torch.set_rng_state(state["rng"]["cpu"])
        if device_type == "cuda" and state["rng"].get("cuda") is not None:
            torch.cuda.set_rng_state(state["rng"]["cuda"])

    # The train data is cut into world_size × grad_accum shards and micro-step m of rank r reads shard
    # r·grad_accum + m: every split of the same total batch over processes sees the same data per step.
    num_shards = world_size * grad_accum
    train_loaders = [data_loader(tokenizer, args.device_batch_size, args.max_seq_len, "train", device=device,
                                 rank=rank * grad_accum + m, world_size=num_shards,
                                 resume_state=loader_states[m] if loader_states else None, data_seed=args.data_seed)
                     for m in range(grad_accum)]
    loader_states = [None] * grad_accum

    # every check has passed: only now does the run directory change
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    trackers = tracking.Trackers()  # rank 0 opens them below: one tracked run per run
    if is_master:
        if first == 0 and os.path.exists(os.path.join(run_dir, "config.json")):
            print0(f"note: {run_dir} has no complete checkpoint: starting it again")
        keep_history(metrics_path, first)
        cfg_path = os.path.join(run_dir, "config.json")
        old_cfg = json.load(open(cfg_path)) if first > 0 and os.path.exists(cfg_path) else {}
        record["segments"] = settings_segments(old_cfg, record, first)
        atomic_write_json(cfg_path, record)
        trackers = tracking.open_trackers(tracking.parse_log_to(args.log_to), os.path.basename(run_dir), run_dir, record)
    if first > 0:
        print0(f"resumed from step {first} of {run_dir}")
    if is_ddp:
        dist.barrier()

    ddp = None
    if is_ddp:  # gradients averaged across ranks, bucketed and overlapped with the backward
        from torch.nn.parallel import DistributedDataParallel
        ddp = DistributedDataParallel(model, device_ids=[local_rank] if device_type == "cuda" else None)
    # compile outside DDP, so the compiled graph is split at DDP's bucket boundaries and the all-reduce overlaps
    fwd = torch.compile(ddp or model, dynamic=False) if use_compile else (ddp or model)
    # evaluation goes around DDP (run_eval says why): the compiled model itself, not the compiled DDP wrapper
    eval_fwd = fwd if ddp is None else (torch.compile(model, dynamic=False) if use_compile else model)

    flops_per_token = plan.flops_per_token
    print0(f"run {plan.run} → {run_dir}")
    print0(f"arch {plan.arch} | {record['num_params']:,} params (S = {record['num_scaling_params']:,} for the size rules) | "
           f"d{plan.config.n_layer} dim {plan.config.n_embd} heads {plan.config.n_head} | device {device_type} × {world_size} | {record['compute_dtype']}")
    print0(f"attention: {record['attention']['kernel']} ({record['attention']['reason']})")
    print0(f"horizon: {num_iterations:,} steps × {total_batch:,} tokens = {record['total_tokens']:,} tokens | "
           f"{flops_per_token:,} FLOPs/token | {record['total_flops']:.3e} FLOPs | grad accum {grad_accum} | "
           f"checkpoint every {plan.save_every or num_iterations} steps")
    evaluating = args.eval_every > 0
    eval_steps = eval_batches(tokenizer, args) if evaluating else 0
    peak = peak_flops(device_type)

    val_batches = []  # the same val batches at every evaluation: read and tokenized once

    # several processes: a rank that waits too long for the others stops the run and names the silent ranks
    watchdog = Watchdog(rank, world_size) if is_ddp else None

    def progress(phase, step, timeout):
        if watchdog:
            watchdog.progress(phase, step, timeout)

    def run_eval(step):
        progress("evaluation", step, args.start_timeout)
        model.eval()
        model.set_tokens_seen(step * total_batch)  # NAG: the α warm-up factor the checkpoint of this step carries
        if not val_batches:  # this rank's share of the batches one process would read
            val = data_loader(tokenizer, args.device_batch_size, args.max_seq_len, "val")
            val_batches.extend(shared_batches(val, eval_steps, rank, world_size, device))
        # not through DDP: ranks may hold one batch more or less than each other, and DDP's forward syncs buffers
        bpb = evaluate_bpb_shared(eval_fwd, val_batches, token_bytes)
        model.train()
        return bpb

    def write_row(row):
        if is_master:
            with open(metrics_path, "a") as f:
                f.write(json.dumps(row) + "\n")
            trackers.log(row)

    if first == 0:
        row = {"step": 0, "tokens": 0, "flops": 0, "train_loss": None, "lr_mult": lr_multiplier(0, plan), "tok_per_sec": None}
        if evaluating:
            row["val_bpb"] = run_eval(0)
            print0(f"step 0 | val bpb {row['val_bpb']:.4f}")
        write_row(row)

    def save(step):
        progress("checkpoint save", step, args.start_timeout)
        train_state = {"optimizer": optimizer.state_dict(), "dataloader": loader_states, "elapsed": elapsed,
                       "rng": {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state() if device_type == "cuda" else None}}
        meta = {"arch": plan.arch, "model_config": plan.config.to_dict(), **model.extra_meta(),
                "step": step, "tokens": step * total_batch, "world_size": world_size, "fingerprints": record["fingerprints"]}
        ckpt.save_checkpoint(run_dir, step, model, meta, train_state, rank)
        print0(f"saved checkpoint at step {step} in {run_dir}")
        if is_master and args.keep_checkpoints and (pruned := ckpt.prune_checkpoints(run_dir, args.keep_checkpoints)):
            print0(f"deleted the checkpoint(s) of step {', '.join(map(str, pruned))} (--keep-checkpoints {args.keep_checkpoints})")

    def logs(step):
        """Whether `step` writes a row: every --log-every-th, and every one that evaluates, saves or ends the run. The
        same on every rank, so they all read (and stop) at the same steps."""
        return (step % args.log_every == 0 or step == num_iterations or (evaluating and step % args.eval_every == 0)
                or (plan.save_every > 0 and step % plan.save_every == 0))

    step = first
    intervals = []  # (steps, training seconds) of each row: the ETA
    stop_flag = torch.zeros((), device=device)
    slow_step = True  # the first step compiles, a step after an evaluation may recompile: the start-up timeout
    # Where each row's time went (nanochat/step_timer.py): the parts of the interval since the previous row, which
    # also holds the checkpoint written after that row (a row goes out before its step's checkpoint, so that no
    # checkpoint lacks its row). Marks cost no sync; the timer is read where a logged step syncs anyway.
    timer = StepTimer(device)
    # A step that logs no row leaves its loss on the device and reads nothing: its non-finite check and SIGTERM flag
    # are copied to the host without waiting and read during the next step, once that step's work is queued. A
    # SIGTERM therefore stops the run one step later than on a logged step, whatever --log-every is.
    late = Readback(device)
    last_row = first
    batch = None  # the next micro-batch, fetched while the device works on the current one
    while step < num_iterations:
        progress("the first step" if step == first else "a training step", step + 1, args.start_timeout if slow_step else args.step_timeout)
        model.set_tokens_seen(step * total_batch)
        loss_sum = torch.zeros((), device=device)
        for micro in range(grad_accum):
            if batch is None:  # the first micro-batch of this process, or every one without PREFETCH
                batch = next(train_loaders[micro])
                timer.mark("data")
            # a checkpoint saves the loader state after the micro-batches consumed, never after one fetched ahead
            x, y, loader_states[micro] = batch
            batch = None
            sync = micro == grad_accum - 1 or not is_ddp
            with (contextlib.nullcontext() if sync else ddp.no_sync()):
                loss = fwd(x, y)
                loss_sum += loss.detach()
                (loss / grad_accum).backward()
            timer.mark("fwd_bwd")
            if PREFETCH and (micro + 1 < grad_accum or step + 1 < num_iterations):
                # the next micro-batch (of this step or the next) is read and packed on the host while the device runs
                # this backward: nothing before this line waits for the device
                batch = next(train_loaders[(micro + 1) % grad_accum])
                timer.mark("data")
        stopping = False
        if (pending := late.take()) is not None:  # the previous step's checks (it logged no row)
            values, (late_step, names) = pending
            check_finite_late([values[0]] + values[2:], late_step, names, args.log_every)
            stopping = values[1] > 0
        logged = stopping or logs(step + 1)  # a stop saves, and a save logs
        # the loss and SIGTERM in one all-reduce: every rank learns in the same step that one of them was asked to stop
        if stop.requested:
            stop_flag.fill_(1.0)  # a kernel, not a host-to-device copy: no sync with the work queued before it
        reduced = torch.stack([loss_sum, stop_flag])
        if is_ddp:
            dist.all_reduce(reduced)
            reduced[0] /= world_size
        train_loss = reduced[0] / grad_accum
        if logged:
            check_finite(model, train_loss, step + 1, x)
        else:
            flags = finite_flags(model, train_loss)
            late.put(torch.cat([train_loss.reshape(1), reduced[1:], flags]), (step + 1, graded_names(model)))
        timer.mark("sync_log")
        lrm = lr_multiplier(step, plan)
        for group in optimizer.param_groups:
            group["lr"] = group["initial_lr"] * lrm
            if group["kind"] == "muon":
                group["momentum"] = momentum_at(step, plan, args)
                group["weight_decay"] = group["initial_weight_decay"] * 0.5 * (1 + math.cos(math.pi * step / num_iterations))
        optimizer.step()
        model.after_optimizer_step()
        model.zero_grad(set_to_none=True)
        timer.mark("optim")
        step += 1
        slow_step = False
        if step == first + 1 and freeze_gc:
            # Start-up and compilation leave many objects that live to the end; every full collection would walk them
            # all again, a host pause of a second or more in which the device runs dry. Collected once, then frozen:
            # out of the collector's sight.
            gc.collect()
            gc.freeze()
            timer.mark("sync_log")
        if not logged:
            continue

        train_loss, stopping = train_loss.item(), stopping or reduced[1].item() > 0  # waits for the optimizer step: logged steps only
        timer.mark("sync_log")
        row = {"step": step, "tokens": step * total_batch, "flops": step * total_batch * flops_per_token,
               "train_loss": train_loss, "lr_mult": lrm}
        # the packing's kept fraction on this rank's shards (the data budget assumes one: docs/reproduce.md), and the epoch
        read_into_rows = step * grad_accum * args.device_batch_size * (args.max_seq_len + 1)
        dropped = sum(s.get("dropped_tokens", 0) for s in loader_states)
        row.update(data_kept=read_into_rows / (read_into_rows + dropped), data_epoch=max(s["epoch"] for s in loader_states))
        row.update(model.step_metrics())  # e.g. MoD's realised skip rates and FLOPs since the last row (every rank pops its own)
        stats_line = None
        if is_master:
            stats, stats_line = model.telemetry(step, x, args)
            if stats is not None:
                row["gate"] = stats
        timer.mark("sync_log")
        last = step == num_iterations
        if evaluating and (last or step % args.eval_every == 0):
            row["val_bpb"] = run_eval(step)
            timer.mark("eval")
            slow_step = True

        parts, wall = timer.read()
        steps, last_row = step - last_row, step
        train_seconds = wall - parts.get("eval", 0.0) - parts.get("save", 0.0)  # tok/s and elapsed as before: training only
        elapsed += train_seconds
        intervals.append((steps, train_seconds))
        recent = intervals[-20:]
        eta = (num_iterations - step) * sum(t for _, t in recent) / sum(n for n, _ in recent)
        tok_per_sec = steps * total_batch / train_seconds
        row.update(tok_per_sec=tok_per_sec, elapsed=elapsed, time=parts)
        mfu = None
        if peak:
            mfu = flops_per_token * tok_per_sec / (peak * world_size)
            row["mfu"] = mfu
        print0(f"step {step:05d}/{num_iterations:05d} ({100 * step / num_iterations:5.1f}%) | loss {train_loss:.4f} | "
               f"lrm {lrm:.3f} | {tok_per_sec:,.0f} tok/s" + (f" | mfu {100 * mfu:.1f}%" if mfu is not None else "") +
               f" | {1000 * train_seconds / steps:.0f} ms | {biggest(parts)} | elapsed {fmt_time(elapsed)} | eta {fmt_time(eta)}")
        if stats_line:
            print0(stats_line)
        if "val_bpb" in row:
            print0(f"step {step:05d} | val bpb {row['val_bpb']:.4f}")
        write_row(row)
        timer.mark("sync_log")
        if last or stopping or (plan.save_every > 0 and step % plan.save_every == 0):
            save(step)
            timer.mark("save")
            slow_step = True
        if stopping and not last:
            print0(f"stopped by SIGTERM after step {step}: its checkpoint is complete; continue with --resume latest "
                   f"(exit status {EXIT_PREEMPTED})")
            if watchdog:
                watchdog.stop()
            if is_ddp:
                dist.destroy_process_group()
            trackers.close()
            sys.exit(EXIT_PREEMPTED)

    if device_type == "cuda":
        print0(f"peak memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
    print0(f"done: {num_iterations} steps in {fmt_time(elapsed)}; run directory {run_dir}")
    if watchdog:
        watchdog.stop()
    if is_ddp:
        dist.destroy_process_group()
    trackers.close()
    return run_dir


def main(argv=None):
    with exit_on_user_error(NonFiniteError, interrupted="interrupted: every checkpoint written so far is complete; "
                            "continue from the newest with --resume latest"):
        return train(parse_args(argv), freeze_gc=argv is None)


if __name__ == "__main__":
    main()
