"""
Pretrain a base model: the GPT baseline (--arch gpt) or NAG (--arch nag).

    python -m scripts.base_train --depth 4 --max-seq-len 256 --device-batch-size 8 --num-iterations 200
    torchrun --nproc_per_node=8 -m scripts.base_train --depth 20 --arch nag --target-flops 1e19

Writes $NANOCHAT_BASE_DIR/runs/<run>/: config.json, metrics.jsonl, checkpoints.
"""

import os
import sys
import json
import math
import time
import argparse
import contextlib
import subprocess

import torch
import torch.distributed as dist

from nanochat.common import UserError, exit_on_user_error, print0, dist_init, autodetect_device_type, compute_dtype_for, atomic_write_bytes
from nanochat.gpt import GPT, GPTConfig
from nanochat.tokenizer import get_tokenizer, get_token_bytes
from nanochat.dataloader import data_loader
from nanochat.loss_eval import evaluate_bpb
from nanochat import checkpoint_manager as ckpt

REFERENCE_BATCH = 2 ** 19  # tokens; the d12 reference of the muP-style batch rules
REFERENCE_DEPTH = 12
BATCH_EXPONENT = 0.383
MAX_DECAY_PER_STEP = 0.01


def build_parser():
    p = argparse.ArgumentParser(description="Pretrain a GPT or NAG base model.")
    p.add_argument("--run", type=str, default=None, help="run name (directory under $NANOCHAT_BASE_DIR/runs); default <arch>-d<depth>")
    p.add_argument("--arch", type=str, default="gpt", choices=["gpt", "nag"])
    p.add_argument("--device-type", type=str, default="", help="cuda|cpu|mps (default: autodetect)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None, help="torch.compile the model (default: on for cuda)")
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
    p.add_argument("--total-batch-size", type=int, default=-1, help="tokens per optimizer step (default: auto from the data budget)")
    # optimization
    p.add_argument("--embedding-lr", type=float, default=0.3)
    p.add_argument("--unembedding-lr", type=float, default=0.004)
    p.add_argument("--matrix-lr", type=float, default=0.02)
    p.add_argument("--weight-decay", type=float, default=0.2)
    p.add_argument("--muon-momentum", type=float, default=-1.0, help="constant Muon momentum (default: 0.85→0.97 ramp, 0.90 in warm-down)")
    p.add_argument("--warmup-steps", type=int, default=40)
    p.add_argument("--warmdown-ratio", type=float, default=0.65)
    p.add_argument("--final-lr-frac", type=float, default=0.05)
    # evaluation and checkpoints
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--eval-tokens", type=int, default=10 * 2 ** 19)
    p.add_argument("--save-every", type=int, default=-1, help="save every N steps (the last step is always saved)")
    p.add_argument("--resume-from-step", type=int, default=-1)
    p.add_argument("--dry-run", type=int, default=0, metavar="NPROC",
                   help="print the plan for NPROC processes (params, FLOPs, steps, tokens, time, disk) and exit; needs no data or GPU")
    p.add_argument("--dry-run-vocab", type=int, default=32768, help="vocab size assumed by --dry-run (0 = the trained tokenizer's)")
    from nag.model import add_nag_args
    add_nag_args(p)
    return p


# ---------------------------------------------------------------------------
# derived configuration


def model_config_from_args(args, vocab_size):
    if args.depth < 1:
        raise UserError(f"--depth must be at least 1 (got {args.depth})")
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
    return GPTConfig(sequence_len=args.max_seq_len, vocab_size=vocab_size, n_layer=args.depth, n_head=n_head,
                     n_kv_head=n_kv, n_embd=dim, window_pattern=args.window_pattern)


def meta_model(cls, config, **kwargs):
    with torch.device("meta"):
        return cls(config, **kwargs)


def reference_tokens(config, ratio):
    """Data budget of the d12 reference model at the same vocab and sequence length."""
    ref = GPTConfig(sequence_len=config.sequence_len, vocab_size=config.vocab_size, n_layer=REFERENCE_DEPTH,
                    n_head=6, n_kv_head=6, n_embd=768)
    return ratio * meta_model(GPT, ref).num_scaling_params()


def plan_horizon(args, model, world_tokens_per_fwdbwd):
    """(total_batch_size, num_iterations, lr_scale, weight_decay) from the muP-style rules of DESIGN §2."""
    flops_per_token = model.estimate_flops()
    ratio = args.target_param_data_ratio if args.target_param_data_ratio > 0 else build_parser().get_default("target_param_data_ratio")
    if args.target_flops > 0:
        data_tokens = args.target_flops / flops_per_token
    else:
        data_tokens = ratio * model.num_scaling_params()
    ref_tokens = reference_tokens(model.config, ratio)
    batch = args.total_batch_size
    if batch <= 0:
        ideal = REFERENCE_BATCH * (data_tokens / ref_tokens) ** BATCH_EXPONENT
        batch = 2 ** round(math.log2(ideal))
        batch = max(1, round(batch / world_tokens_per_fwdbwd)) * world_tokens_per_fwdbwd  # whole micro-batches on every process
    if batch % world_tokens_per_fwdbwd:
        raise UserError(f"--total-batch-size {batch} is not a multiple of device batch × seq len × processes = {world_tokens_per_fwdbwd}")
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
    tokens = steps * batch
    lr_scale = math.sqrt(batch / REFERENCE_BATCH)
    weight_decay = args.weight_decay * lr_scale * (ref_tokens / tokens)
    # far below the reference budget the rule explodes (D_ref/D ~ 1e5 on a CPU demo): never shrink
    # the matrices by more than MAX_DECAY_PER_STEP in one step
    max_wd = MAX_DECAY_PER_STEP / (args.matrix_lr * lr_scale)
    if weight_decay > max_wd:
        print0(f"note: the weight-decay rule gives {weight_decay:.3g} at this small budget; capped to {max_wd:.3g} "
               f"(lr × wd ≤ {MAX_DECAY_PER_STEP} per step)")
        weight_decay = max_wd
    return batch, steps, lr_scale, weight_decay


def lr_multiplier(step, num_iterations, warmup_steps, warmdown_ratio, final_lr_frac):
    warmdown = round(warmdown_ratio * num_iterations)
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if step <= num_iterations - warmdown:
        return 1.0
    progress = (num_iterations - step) / warmdown
    return progress + (1 - progress) * final_lr_frac


def muon_momentum(step, num_iterations, warmdown_ratio):
    # 0.85 → 0.97 over the first 400 steps, then down to 0.90 across the warm-down
    frac = min(step / 400, 1.0)
    m = (1 - frac) * 0.85 + frac * 0.97
    warmdown = round(warmdown_ratio * num_iterations)
    start = num_iterations - warmdown
    if warmdown > 0 and step > start:
        p = (step - start) / warmdown
        m = (1 - p) * m + p * 0.90
    return m


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


# ---------------------------------------------------------------------------
# safety


class NonFiniteError(Exception):
    pass


def check_finite(model, loss, step):
    """Stop on a non-finite loss or gradient, naming the step and the offending parameters."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    total = torch.stack(torch._foreach_norm(grads)).sum() if grads else torch.zeros((), device=loss.device)
    if (torch.isfinite(loss) & torch.isfinite(total)).item():  # one host sync
        return
    bad = [n for n, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
    shown = ", ".join(bad[:12]) + (f" (+{len(bad) - 12} more)" if len(bad) > 12 else "")
    raise NonFiniteError(f"non-finite {'loss' if not torch.isfinite(loss) else 'gradient'} at step {step} "
                         f"(loss {loss.item():.4g}); non-finite gradients in: {shown or 'none'}")


# ---------------------------------------------------------------------------


def prepare_run_dir(run_dir, args, config_record, tokenizer, is_master):
    """Refuse to overwrite another run; on resume, refuse a different model, tokenizer or batch layout."""
    cfg_path = os.path.join(run_dir, "config.json")
    if args.resume_from_step < 0:
        if os.path.exists(cfg_path) or ckpt.saved_steps(run_dir):
            raise UserError(f"{run_dir} already holds a run; pick another --run or continue it with --resume-from-step N")
    else:
        ckpt.check_vocab(ckpt.load_meta(run_dir, args.resume_from_step), tokenizer)
        if os.path.exists(cfg_path):
            old = json.load(open(cfg_path))
            # the data shards are laid out per (process, micro-step): both must match for an exact resume
            for key in ("arch", "model_config", "total_batch_size", "world_size", "grad_accum_steps"):
                if old.get(key) != config_record.get(key):
                    raise UserError(f"cannot resume {run_dir}: its {key} was {old.get(key)} but this command gives {config_record.get(key)}")
    if is_master:
        os.makedirs(run_dir, exist_ok=True)


def truncate_metrics(path, last_step):
    """On resume, drop the rows past the checkpoint so the log reads like an uninterrupted run."""
    if not os.path.exists(path):
        return
    keep = [line for line in open(path) if line.strip() and json.loads(line)["step"] <= last_step]
    atomic_write_bytes(path, "".join(keep).encode())


def dry_run(args):
    """The plan of a run, computed on the meta device: nothing is allocated, no data is read."""
    vocab_size = args.dry_run_vocab or get_tokenizer().get_vocab_size()
    from nag.model import nag_config_from_args
    config = model_config_from_args(args, vocab_size)
    cls = ckpt.model_class(args.arch)
    model = meta_model(cls, config, **({"nag": nag_config_from_args(args)} if args.arch == "nag" else {}))
    nproc = args.dry_run
    world_tokens = args.device_batch_size * args.max_seq_len * nproc
    batch, steps, lr_scale, weight_decay = plan_horizon(args, model, world_tokens)
    fpt = model.estimate_flops()
    params = sum(p.numel() for p in model.parameters())
    plan = {"run": args.run or f"{args.arch}-d{args.depth}", "arch": args.arch, "vocab_size": vocab_size, "depth": config.n_layer,
            "model_dim": config.n_embd, "n_head": config.n_head, "seq_len": config.sequence_len, "num_params": params,
            "num_scaling_params": model.num_scaling_params(), "flops_per_token": fpt, "num_iterations": steps,
            "total_batch_size": batch, "grad_accum_steps": batch // world_tokens, "nproc": nproc,
            "total_tokens": steps * batch, "total_flops": fpt * steps * batch, "lr_scale": lr_scale,
            # fp32 weights + optimizer state (AdamW: 2 fp32 moments; Muon: 1 momentum + small variance) ≈ 12-16 bytes/param
            "checkpoint_gib": params * 16 / 2 ** 30}
    print(f"PLAN {json.dumps(plan)}")
    print(f"{plan['run']}: {args.arch} d{config.n_layer} dim {config.n_embd} | {params:,} params | {fpt:,} FLOPs/token | "
          f"{steps:,} steps × {batch:,} tokens = {steps * batch:,} tokens | {plan['total_flops']:.4g} FLOPs | "
          f"grad accum {plan['grad_accum_steps']} on {nproc} process(es)")
    return plan


def train(args):
    if args.dry_run:
        return dry_run(args)
    device_type = args.device_type or autodetect_device_type()
    is_ddp, rank, local_rank, world_size, device = dist_init(device_type)
    is_master = rank == 0
    torch.manual_seed(args.seed)
    compute_dtype = compute_dtype_for(device_type)
    if device_type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    tokenizer = get_tokenizer()
    token_bytes = get_token_bytes(device=device)
    vocab_size = tokenizer.get_vocab_size()
    config = model_config_from_args(args, vocab_size)

    from nag.model import nag_config_from_args, nag_optimizer_kwargs
    cls = ckpt.model_class(args.arch)
    model_kwargs = {"nag": nag_config_from_args(args), "impl": args.nag_impl or None} if args.arch == "nag" else {}

    # build for free on the meta device, then materialise and initialise
    model = meta_model(cls, config, **model_kwargs)
    tokens_per_fwdbwd = args.device_batch_size * args.max_seq_len
    world_tokens_per_fwdbwd = tokens_per_fwdbwd * world_size
    total_batch, num_iterations, lr_scale, weight_decay = plan_horizon(args, model, world_tokens_per_fwdbwd)
    grad_accum = total_batch // world_tokens_per_fwdbwd
    flops_per_token = model.estimate_flops()
    model.to_empty(device=device)
    model.init_weights()
    model.set_compute_dtype(compute_dtype)

    run = args.run or f"{args.arch}-d{args.depth}"
    run_dir = ckpt.get_run_dir(run)
    meta = {"arch": args.arch, "model_config": config.to_dict(), **model.extra_meta()}
    config_record = {
        "run": run, "arch": args.arch, "args": vars(args), "model_config": config.to_dict(), **model.extra_meta(),
        "num_params": sum(p.numel() for p in model.parameters()), "num_scaling_params": model.num_scaling_params(),
        "flops_per_token": flops_per_token, "num_iterations": num_iterations, "total_batch_size": total_batch,
        "total_tokens": num_iterations * total_batch, "total_flops": flops_per_token * num_iterations * total_batch,
        "grad_accum_steps": grad_accum, "lr_scale": lr_scale, "weight_decay_effective": weight_decay,
        "world_size": world_size, "device_type": device_type, "compute_dtype": str(compute_dtype).replace("torch.", ""),
        "seed": args.seed, "git_commit": git_commit(), "torch_version": torch.__version__, "command": " ".join(sys.argv),
    }
    prepare_run_dir(run_dir, args, config_record, tokenizer, is_master)
    if is_ddp:
        dist.barrier()  # every rank checks the run dir before rank 0 writes into it

    optimizer = model.setup_optimizer(embedding_lr=args.embedding_lr, unembedding_lr=args.unembedding_lr,
                                      matrix_lr=args.matrix_lr, weight_decay=weight_decay, lr_scale=lr_scale,
                                      **(nag_optimizer_kwargs(args) if args.arch == "nag" else {}))

    start_step, loader_states, elapsed = 0, None, 0.0
    if args.resume_from_step >= 0:
        start_step = args.resume_from_step
        ckpt.load_weights(model, ckpt.load_model_file(run_dir, start_step, device))
        state = ckpt.load_train_state(run_dir, start_step, rank)  # on the CPU: RNG states must stay there
        # the optimizer state is replicated across ranks, so only rank 0 saved it (load_state_dict moves it to the params' device)
        optimizer.load_state_dict(state["optimizer"] if rank == 0 else ckpt.load_train_state(run_dir, start_step, 0)["optimizer"])
        loader_states, elapsed = state["dataloader"], state.get("elapsed", 0.0)
        torch.set_rng_state(state["rng"]["cpu"])
        if device_type == "cuda" and state["rng"].get("cuda") is not None:
            torch.cuda.set_rng_state(state["rng"]["cuda"])
        print0(f"resumed from step {start_step} of {run_dir}")

    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    if is_master:
        from nanochat.common import atomic_write_json
        atomic_write_json(os.path.join(run_dir, "config.json"), config_record)
        if args.resume_from_step >= 0:
            truncate_metrics(metrics_path, start_step)
        elif os.path.exists(metrics_path):
            os.remove(metrics_path)

    use_compile = args.compile if args.compile is not None else device_type == "cuda"
    ddp = None
    if is_ddp:  # gradients averaged across ranks, bucketed and overlapped with the backward
        from torch.nn.parallel import DistributedDataParallel
        ddp = DistributedDataParallel(model, device_ids=[local_rank] if device_type == "cuda" else None)
    # compile outside DDP, so the compiled graph is split at DDP's bucket boundaries and the all-reduce overlaps
    fwd = torch.compile(ddp or model, dynamic=False) if use_compile else (ddp or model)

    print0(f"run {run} → {run_dir}")
    print0(f"arch {args.arch} | {config_record['num_params']:,} params ({config_record['num_scaling_params']:,} matmul) | "
           f"d{config.n_layer} dim {config.n_embd} heads {config.n_head} | device {device_type} × {world_size} | {config_record['compute_dtype']}")
    print0(f"horizon: {num_iterations:,} steps × {total_batch:,} tokens = {num_iterations * total_batch:,} tokens | "
           f"{flops_per_token:,} FLOPs/token | {config_record['total_flops']:.3e} FLOPs | grad accum {grad_accum}")

    # The train data is cut into world_size × grad_accum shards and micro-step m of rank r reads shard
    # r·grad_accum + m: every split of the same total batch over processes sees the same data per step.
    num_shards = world_size * grad_accum
    train_loaders = [data_loader(tokenizer, args.device_batch_size, args.max_seq_len, "train", device=device,
                                 rank=rank * grad_accum + m, world_size=num_shards,
                                 resume_state=loader_states[m] if loader_states else None) for m in range(grad_accum)]
    loader_states = [None] * grad_accum
    eval_steps = max(1, args.eval_tokens // world_tokens_per_fwdbwd)
    peak = peak_flops(device_type)

    val_batches = []  # the same val batches at every evaluation: read and tokenized once

    def run_eval(step):
        model.eval()
        model.set_tokens_seen(step * total_batch)  # NAG: the α warm-up factor the checkpoint of this step carries
        if not val_batches:
            val = data_loader(tokenizer, args.device_batch_size, args.max_seq_len, "val", device=device, rank=rank, world_size=world_size)
            val_batches.extend(next(val)[:2] for _ in range(eval_steps))
        bpb = evaluate_bpb(fwd, iter(val_batches), eval_steps, token_bytes)
        model.train()
        return bpb

    def write_row(row):
        if is_master:
            with open(metrics_path, "a") as f:
                f.write(json.dumps(row) + "\n")

    if start_step == 0:
        bpb = run_eval(0)
        print0(f"step 0 | val bpb {bpb:.4f}")
        write_row({"step": 0, "tokens": 0, "flops": 0, "train_loss": None, "lr_mult": lr_multiplier(0, num_iterations, args.warmup_steps, args.warmdown_ratio, args.final_lr_frac),
                   "tok_per_sec": None, "val_bpb": bpb})

    step = start_step
    step_times = []
    while step < num_iterations:
        t0 = time.time()
        model.set_tokens_seen(step * total_batch)
        loss_sum = torch.zeros((), device=device)
        for micro in range(grad_accum):
            x, y, loader_states[micro] = next(train_loaders[micro])
            sync = micro == grad_accum - 1 or not is_ddp
            with (contextlib.nullcontext() if sync else ddp.no_sync()):
                loss = fwd(x, y)
                loss_sum += loss.detach()
                (loss / grad_accum).backward()
        if is_ddp:
            dist.all_reduce(loss_sum)
            loss_sum /= world_size
        train_loss = loss_sum / grad_accum
        check_finite(model, train_loss, step + 1)
        lrm = lr_multiplier(step, num_iterations, args.warmup_steps, args.warmdown_ratio, args.final_lr_frac)
        for group in optimizer.param_groups:
            group["lr"] = group["initial_lr"] * lrm
            if group["kind"] == "muon":
                group["momentum"] = args.muon_momentum if args.muon_momentum > 0 else muon_momentum(step, num_iterations, args.warmdown_ratio)
                group["weight_decay"] = group["initial_weight_decay"] * 0.5 * (1 + math.cos(math.pi * step / num_iterations))
        optimizer.step()
        model.after_optimizer_step()
        model.zero_grad(set_to_none=True)
        train_loss = train_loss.item()  # also syncs the device, so the timing below is honest
        step += 1
        dt = time.time() - t0
        elapsed += dt
        step_times.append(dt)

        tok_per_sec = total_batch / dt
        recent = step_times[-20:]
        eta = (num_iterations - step) * sum(recent) / len(recent)
        row = {"step": step, "tokens": step * total_batch, "flops": step * total_batch * flops_per_token,
               "train_loss": train_loss, "lr_mult": lrm, "tok_per_sec": tok_per_sec, "elapsed": elapsed}
        mfu = None
        if peak:
            mfu = flops_per_token * tok_per_sec / (peak * world_size)
            row["mfu"] = mfu
        line = (f"step {step:05d}/{num_iterations:05d} ({100 * step / num_iterations:5.1f}%) | loss {train_loss:.4f} | "
                f"lrm {lrm:.3f} | {tok_per_sec:,.0f} tok/s" + (f" | mfu {100 * mfu:.1f}%" if mfu is not None else "") +
                f" | {dt * 1000:.0f} ms | elapsed {fmt_time(elapsed)} | eta {fmt_time(eta)}")
        print0(line)
        if args.arch == "nag" and is_master and args.nag_gate_log_every > 0 and step % args.nag_gate_log_every == 0:
            row["gate"] = model.gate_telemetry(x)  # one extra no-grad forward on the last micro-batch
            print0(model.format_telemetry(row["gate"]))

        last = step == num_iterations
        if last or (args.eval_every > 0 and step % args.eval_every == 0):
            row["val_bpb"] = run_eval(step)
            print0(f"step {step:05d} | val bpb {row['val_bpb']:.4f}")
        write_row(row)
        if last or (args.save_every > 0 and step % args.save_every == 0):
            train_state = {"optimizer": optimizer.state_dict() if is_master else None, "dataloader": loader_states, "elapsed": elapsed,
                           "rng": {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state() if device_type == "cuda" else None}}
            ckpt.save_checkpoint(run_dir, step, model, dict(meta, step=step, tokens=step * total_batch), train_state, rank)
            print0(f"saved checkpoint at step {step} in {run_dir}")

    if device_type == "cuda":
        print0(f"peak memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
    print0(f"done: {num_iterations} steps in {fmt_time(elapsed)}; run directory {run_dir}")
    if is_ddp:
        dist.destroy_process_group()
    return run_dir


def main(argv=None):
    args = build_parser().parse_args(argv)
    with exit_on_user_error(NonFiniteError):
        return train(args)


if __name__ == "__main__":
    main()
