"""
Pretrain a base model: the GPT baseline (--arch gpt) or NAG (--arch nag).

nag/archs.py lists the archs.

    python -m scripts.base_train --depth 2 --max-seq-len 64 --device-batch-size 4 --total-batch-size 256 --num-iterations 20 --eval-every 10 --eval-tokens 1024
    python -m scripts.base_train --preset published --arch nag --dry-run 8        # the plan only; no data, no GPU
    torchrun --nproc_per_node=8 -m scripts.base_train -- --preset published --arch nag --resume latest   (GPU)

Writes $NANOCHAT_BASE_DIR/runs/<run>/: config.json, metrics.jsonl, checkpoints (docs/runs.md).
`--resume latest` continues from the newest complete checkpoint, starts a run that has none,
and does nothing for a finished run. What a run will do is nanochat/plan.py's; where it starts again,
nanochat/resume.py's; this file is the command line and the training loop.
"""

import os
import gc
import sys
import json
import argparse
import contextlib
from dataclasses import dataclass, field

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

from nanochat.common import (
    UserError,
    exit_on_user_error,
    print0,
    dist_init,
    autodetect_device_type,
    compute_dtype_for,
    atomic_write_json,
    check_run_name,
    ensure_writable_dir,
    git_commit,
    package_versions,
    fmt_time,
)
from nanochat.distributed import EXIT_PREEMPTED, StopRequest, Watchdog, check_shared_dir, rank0_decides
from nanochat.flash_attention import agree_attention, attention_shapes, expected_attention
from nanochat import step_timer
from nanochat.step_timer import StepTimer, Readback, biggest
from nanochat.tokenizer import get_tokenizer, get_token_bytes
from nanochat.dataloader import data_loader, MicroBatches
from nanochat.loss_eval import evaluate_bpb_shared, held_batches, shared_batches
from nanochat.gpt import GPTConfig
from nanochat.optim import MuonAdamW
from nanochat.plan import PLANNED_MFU, Plan, lr_multiplier, momentum_at, muon_weight_decay, planned_seconds
from nanochat.nonfinite import NonFiniteError, finite_flags, graded_names, check_finite, check_finite_late
from nanochat import fp8
from nanochat import resume
from nanochat import run_dir as run_files
from nanochat import checkpoint_manager as ckpt
from nanochat import tracking
from nag.mod import overflow_warning
from nag.archs import NOT_SETTINGS, arch_spec, check_args, ignored_flags, unread_flags, plan_for
from nag.presets import PRESETS
from nag.train_flags import DRY_RUN_VOCAB, build_parser, parse_args, start_timeout, stated_flags

TRACKER_PROJECT = "nag-chat"  # the project --log-to's trackers log under (wandb: $WANDB_PROJECT wins)


def dry_run(args):
    """The plan of a run, computed on the meta device: nothing is allocated, no data is read."""
    plan = plan_for(args, PRESETS.get(args.preset, {}).get("vocab", DRY_RUN_VOCAB), args.dry_run)
    record = plan.record(args)
    record["attention"] = expected_attention(args.attn, args.preset if PRESETS.get(args.preset, {}).get("gpu") else "")
    print(f"PLAN {json.dumps(record)}")
    c = plan.config
    print(
        f"{plan.run}: {plan.arch} d{c.n_layer} dim {c.n_embd} | {record['num_params']:,} params | "
        f"{plan.flops_per_token:,} FLOPs/token | {plan.num_iterations:,} steps × {plan.total_batch:,} tokens = "
        f"{record['total_tokens']:,} tokens | {record['total_flops']:.4g} FLOPs | "
        f"grad accum {plan.grad_accum} on {plan.nproc} process(es) | warm-up {plan.warmup_steps}, warm-down "
        f"{plan.warmdown_steps} steps | checkpoint every {plan.save_every or plan.num_iterations} steps | seed "
        f"{args.seed}, data seed {'none (file order)' if args.data_seed is None else args.data_seed}"
    )
    print(f"attention: {record['attention']['expects']}")
    print(memory_line(plan))
    if plan.target.gpu:
        secs = planned_seconds(record["total_flops"], plan.nproc, plan.target.gpu.peak_flops)
        gpus = f"{plan.nproc} × {plan.target.gpu.label}"
        print(f"time: ≈ {fmt_time(secs)} of training on {gpus} at {PLANNED_MFU:.0%} MFU")
    return record


def memory_line(plan):
    """What the plan says of GPU memory, in one line."""
    if plan.memory is None:
        return (
            f"memory: not planned (a CPU run; --gpu NAME or --gpu-memory GIB plans one for a GPU); device batch "
            f"{plan.device_batch}"
        )
    return f"{plan.target.label}: {plan.memory.line()}"


def eval_batches(tokenizer, args):
    """Val batches per evaluation: --eval-tokens worth, capped at what one pass over the val split packs (no text
    scored twice; nanochat.loss_eval.held_batches). Counted on the whole split, as one process would read it:
    the ranks share these batches (nanochat/loss_eval.py), so val bpb does not depend on their number."""
    batch_tokens = args.device_batch_size * args.max_seq_len
    wanted = max(1, args.eval_tokens // batch_tokens)
    steps = held_batches(tokenizer, args.device_batch_size, args.max_seq_len, "val", wanted)
    if steps < wanted:
        print0(
            f"note: the val split holds about {steps * batch_tokens:,} tokens, fewer than --eval-tokens "
            f"{args.eval_tokens:,}; each evaluation uses those"
        )
    return steps


def freeze_heap():
    """Start-up and compilation leave many objects that live to the end; every full collection would walk them all
    again, a host pause of a second or more in which the device runs dry. Collected once, then frozen: out of the
    collector's sight until the run ends (train unfreezes them)."""
    gc.collect()
    gc.freeze()


@dataclass
class Run:
    """What the training loop works with, once set up: nanochat's shape (plain functions over one record), not a
    Trainer class, so that one step reads top to bottom in this file (docs/design.md §3)."""

    args: argparse.Namespace
    plan: Plan
    record: dict  # config.json
    run_dir: str
    device: torch.device
    rank: int
    world_size: int
    model: torch.nn.Module
    optimizer: MuonAdamW
    forward: object  # the model under DDP and torch.compile, as training calls it
    eval_forward: object  # the compiled model around DDP (run_eval says why)
    ddp: object  # DistributedDataParallel, or None in one process
    batches: MicroBatches
    start: int  # the step it starts (again) from
    elapsed: float  # training seconds before this start
    tokenizer: object
    token_bytes: torch.Tensor
    trackers: tracking.Trackers
    stop: StopRequest
    watchdog: Watchdog = None
    peak_flops: float = None  # the GPU's peak, for MFU (None: unknown, or no GPU)
    eval_steps: int = 0  # val batches per evaluation (0: no evaluation)
    val_batches: list = field(default_factory=list)  # read and tokenized once, the same at every evaluation
    overflow_warned: bool = False  # MoD's overflow warning is printed once per run

    @property
    def device_type(self):
        return self.device.type

    @property
    def is_ddp(self):
        return self.ddp is not None

    @property
    def metrics_path(self):
        return os.path.join(self.run_dir, run_files.METRICS)

    def progress(self, phase, step, timeout):
        if self.watchdog:
            self.watchdog.progress(phase, step, timeout)

    def writes_row(self, step):
        """Whether `step` writes a row: every --log-every-th, and every one that evaluates, saves or ends the run. The
        same on every rank, so they all read (and stop) at the same steps."""
        return (
            step % self.args.log_every == 0
            or step == self.plan.num_iterations
            or self.evaluates(step)
            or self.saves(step)
        )

    def evaluates(self, step):
        return self.eval_steps > 0 and (step % self.args.eval_every == 0 or step == self.plan.num_iterations)

    def saves(self, step):
        return step == self.plan.num_iterations or (self.plan.save_every > 0 and step % self.plan.save_every == 0)


def train(args, stated=None):
    """Train the run the flags describe (args from parse_args; stated: the flags its command line gives itself, see
    continued; None: all); returns its directory (the plan record with --dry-run)."""
    if args.dry_run:
        return dry_run(args)
    args = continued(args, stated)
    check_args(args)  # every flag, before any process group or data: one line
    defaults = build_parser().parse_args([])  # what a flag a run's config.json lacks was (resume's settings check)
    for note in ignored_flags(args, defaults):
        print0(note)
    preset = PRESETS.get(args.preset, {})
    if preset.get("gpu") and not args.device_type and not torch.cuda.is_available():
        raise UserError(
            f"--preset {args.preset} is a GPU configuration and torch {torch.__version__} sees no CUDA device here; "
            f"see its plan with --dry-run N, or pass --device-type cpu to train it on the CPU anyway"
        )
    device_type = args.device_type or autodetect_device_type()
    procs = dist_init(device_type, timeout=start_timeout(args))
    is_ddp, rank, local_rank, world_size, device = procs
    torch.manual_seed(args.seed)
    compute_dtype = compute_dtype_for(device_type)
    if args.fp8 and (why := fp8.cannot_run(device)):
        raise UserError(f"--fp8 cannot run here: {why}; train without --fp8")
    if device_type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    tokenizer = get_tokenizer()
    # the preset's plan and published numbers assume that vocab
    if preset.get("gpu") and tokenizer.get_vocab_size() != preset["vocab"]:
        raise UserError(
            f"--preset {args.preset} trains with a {preset['vocab']:,}-token tokenizer, but the one in the base dir "
            f"has {tokenizer.get_vocab_size():,}; use a fresh NANOCHAT_BASE_DIR, or retrain it with scripts.tok_train "
            f"--vocab-size {preset['vocab']}"
        )
    plan = plan_for(args, tokenizer.get_vocab_size(), world_size, device_type)  # refuses a run that does not fit
    print0(memory_line(plan))
    # rank 0's choice, probed at the model's shapes, on every rank
    attention = agree_attention(
        args.attn,
        device,
        compute_dtype,
        is_ddp,
        args.preset if preset.get("gpu") else "",
        shapes=attention_shapes(plan.model),
    )
    record = plan.record(args)
    record.update(
        args=vars(args),
        device_type=device_type,
        compute_dtype=str(compute_dtype).replace("torch.", ""),
        git_commit=git_commit(),
        versions=package_versions(),
        command=" ".join(sys.argv),
        fingerprints=ckpt.fingerprints(tokenizer),
        attention=attention,
    )
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
        # the heap frozen after the first step, back in the collector's sight however training ends
        stack.callback(gc.unfreeze)
        # one start step for all ranks: rank 0's view of the run directory decides
        start = rank0_decides(
            lambda: resume.start_step(
                run_dir,
                args,
                record,
                tokenizer,
                vars(defaults),
                not_settings(args),
                model_shapes(plan.model),
                saved_model_shapes,
            ),
            is_ddp,
        )
        if start is None:
            print0(f"{run_dir} already finished its {plan.num_iterations} steps; nothing to do")
            if is_ddp:
                dist.destroy_process_group()
            return run_dir
        run = set_up(args, plan, record, run_dir, tokenizer, start, stop, procs, defaults)
        stack.callback(run.batches.close)  # the loader thread stops however training ends
        train_loop(run)
        finish(run)
        return run_dir


def continued(args, stated):
    """A resume's flags: each setting the command line leaves out is the run's at the checkpoint it resumes from
    (nanochat/resume.py continued_args), read before anything starts; the command's flags where there is none. The
    run keeps the directory the command named, whatever default name the run's own flags would give."""
    if stated is None or not (args.resume == "latest" or args.resume.isdigit()):  # check_args refuses a bad one
        return args
    if args.run is not None:
        check_run_name(args.run)
    name = args.run or f"{args.arch}-d{args.depth}"  # plan.py's default name, of the command's own flags
    run_dir = ckpt.resolve_run_dir(name)
    step = resume.checkpoint_step(run_dir, args.resume)
    if step is None:
        return args
    then = resume.run_at(run_dir, step, ckpt.load_meta(run_dir, step))
    args = resume.continued_args(args, stated, then, not_settings)
    args.run = name
    return args


def not_settings(args):
    """The flags that change no number this run trains: every arch's free flags, and the arch flags its arch ignores
    (a note names those given; a resume never compares them)."""
    return NOT_SETTINGS | frozenset(unread_flags(args))


def model_shapes(model):
    """{name: shape} of a model's parameters and buffers: what loading a checkpoint into it needs to match."""
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def saved_model_shapes(meta):
    """model_shapes of the model a checkpoint holds, built from its meta on the meta device (nothing read or
    allocated)."""
    cls = arch_spec(meta["arch"]).model_class
    with torch.device("meta"):
        return model_shapes(cls(GPTConfig(**meta["model_config"]), **cls.extra_init_kwargs(meta)))


def set_up(args, plan, record, run_dir, tokenizer, start, stop, procs, defaults):
    """The model (initialised, or loaded at `start`), optimizer, loaders and trackers of a run (procs: dist_init's
    answer), and its run directory brought to `start`: config.json written, later rows of metrics.jsonl moved aside.
    Nothing changes on disk before every check has passed."""
    is_ddp, rank, local_rank, world_size, device = procs
    device_type = device.type
    model = plan.model
    model.to_empty(device=device)
    model.init_weights()
    model.set_compute_dtype(compute_dtype_for(device_type))
    fp8_layers = model.set_fp8(args.fp8)  # before DDP and compile, as the attention kernel
    # what trains in fp8 (0 where --fp8's size rule admits no layer): compare's precision
    record["fp8_layers"] = len(fp8_layers)
    model.set_attention(record["attention"]["kernel"])  # before DDP and compile: the compiled graph sees a constant
    # compiled on CUDA, Mixture-of-Depths too (its shapes are static: docs/mod.md); torch's own
    # TORCH_COMPILE_DISABLE=1 runs any run eagerly
    use_compile = device_type == "cuda"
    # under DDP each rank updates its chunk of every Muon stack, then all-gathers them (docs/optimizer.md)
    optimizer = MuonAdamW(plan.optimizer_groups(args), rank=rank, world_size=world_size, compile=use_compile)

    loader_states, elapsed = None, 0.0
    if start > 0:
        resume.load_resumed_weights(model, run_dir, start, device)
        state = resume.load_resume_state(run_dir, start, rank, world_size, plan.grad_accum, optimizer)
        loader_states, elapsed = state["dataloader"], state["elapsed"]
        torch.set_rng_state(state["rng"]["cpu"])
        if device_type == "cuda" and state["rng"].get("cuda") is not None:
            torch.cuda.set_rng_state(state["rng"]["cuda"])

    # The train data is cut into world_size × grad_accum shards and micro-step m of rank r reads shard
    # r·grad_accum + m: every split of the same total batch over processes sees the same data per step.
    num_shards = world_size * plan.grad_accum
    # read and packed on the host by a thread of their own while the device trains; MicroBatches copies them over
    batches = MicroBatches(
        [
            data_loader(
                tokenizer,
                args.device_batch_size,
                args.max_seq_len,
                "train",
                rank=rank * plan.grad_accum + m,
                world_size=num_shards,
                resume_state=loader_states[m] if loader_states else None,
                data_seed=args.data_seed,
            )
            for m in range(plan.grad_accum)
        ],
        device,
    )

    # every check has passed: only now does the run directory change
    trackers = tracking.Trackers()  # rank 0 opens them below: one tracked run per run
    summary = ""  # what a resume changes and carries on: rank 0's line
    if rank == 0:
        old_cfg = resume.read_config(run_dir) if start > 0 else {}
        then = resume.run_at(run_dir, start, ckpt.load_meta(run_dir, start)) if start > 0 else {}
        if start == 0 and os.path.exists(os.path.join(run_dir, run_files.CONFIG)):
            print0(f"note: {run_dir} has no complete checkpoint: starting it again")
        if start > 0 and not old_cfg:
            print0(f"note: {run_dir} has no config.json: a new one is written, its settings history from step {start}")
        record["segments"] = resume.settings_segments(old_cfg, then, record, start, vars(defaults), not_settings(args))
        summary = resume.resume_summary(record["segments"], start, then) if start > 0 else ""
        try:  # a full disk: one line; metrics.jsonl and config.json are each rewritten whole or not at all
            run_files.keep_history(os.path.join(run_dir, run_files.METRICS), start)
            atomic_write_json(os.path.join(run_dir, run_files.CONFIG), record)
        except OSError as e:
            raise UserError(
                f"cannot write metrics.jsonl or config.json in {run_dir} ({e.strerror or e}); free space and run the "
                "command again"
            ) from None
        trackers = tracking.open_trackers(
            tracking.parse_log_to(args.log_to), os.path.basename(run_dir), run_dir, record, TRACKER_PROJECT
        )
    if start > 0:
        print0(f"resumed from step {start} of {run_dir}: {summary}")
    if is_ddp:
        dist.barrier()

    ddp = None
    if is_ddp:  # gradients averaged across ranks, bucketed and overlapped with the backward
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model, device_ids=[local_rank] if device_type == "cuda" else None)
    # compile outside DDP, so the compiled graph is split at DDP's bucket boundaries and the all-reduce overlaps
    forward = torch.compile(ddp or model, dynamic=False) if use_compile else (ddp or model)
    eval_forward = forward if ddp is None else (torch.compile(model, dynamic=False) if use_compile else model)

    c = plan.config
    print0(f"run {plan.run} → {run_dir}")
    print0(
        f"arch {plan.arch} | {record['num_params']:,} params (S = {record['num_scaling_params']:,} for the size rules) "
        f"| d{c.n_layer} dim {c.n_embd} heads {c.n_head} | device "
        f"{device_type} × {world_size} | {record['compute_dtype']}"
    )
    print0(f"attention: {record['attention']['kernel']} ({record['attention']['reason']})")
    if args.fp8:
        print0(
            f"fp8: {len(fp8_layers)} linear layers in training (both dims >= {fp8.MIN_DIM}, multiples of "
            f"{fp8.MULTIPLE}); the others, evaluation and sampling in {record['compute_dtype']}"
        )
    print0(
        f"horizon: {plan.num_iterations:,} steps × {plan.total_batch:,} tokens = {record['total_tokens']:,} tokens | "
        f"{plan.flops_per_token:,} FLOPs/token | {record['total_flops']:.3e} FLOPs | grad accum {plan.grad_accum} | "
        f"checkpoint every {plan.save_every or plan.num_iterations} steps"
    )
    return Run(
        args=args,
        plan=plan,
        record=record,
        run_dir=run_dir,
        device=device,
        rank=rank,
        world_size=world_size,
        model=model,
        optimizer=optimizer,
        forward=forward,
        eval_forward=eval_forward,
        ddp=ddp,
        batches=batches,
        start=start,
        elapsed=elapsed,
        tokenizer=tokenizer,
        token_bytes=get_token_bytes(device=device),
        trackers=trackers,
        stop=stop,
        watchdog=Watchdog(rank, world_size) if is_ddp else None,
        peak_flops=plan.target.gpu.peak_flops if plan.target.gpu else None,
        eval_steps=eval_batches(tokenizer, args) if args.eval_every > 0 else 0,
    )


def run_eval(run, step):
    """val bpb at `step`, on the same batches every time."""
    run.progress("evaluation", step, start_timeout(run.args))
    run.model.eval()
    run.model.set_tokens_seen(step * run.plan.total_batch)  # the model as the checkpoint of this step holds it
    if not run.val_batches:  # this rank's share of the batches one process would read
        val = data_loader(run.tokenizer, run.args.device_batch_size, run.args.max_seq_len, "val", one_pass=True)
        run.val_batches.extend(shared_batches(val, run.eval_steps, run.rank, run.world_size, run.device))
    # not through DDP: ranks may hold one batch more or less than each other, and DDP's forward syncs buffers
    bpb = evaluate_bpb_shared(run.eval_forward, run.val_batches, run.token_bytes)
    run.model.train()
    return bpb


def write_row(run, row):
    if run.rank == 0:
        try:
            run_files.append_row(run.metrics_path, row)
        except OSError as e:  # a full disk: one line; the next start moves a torn row aside (run_dir.keep_history)
            done = ckpt.complete_steps(run.run_dir)
            raise UserError(
                f"cannot append the row of step {row['step']} to {run.metrics_path} ({e.strerror or e}); the newest "
                f"complete checkpoint is {f'step {done[-1]}' if done else 'none'}: free space, then continue with "
                "--resume latest"
            ) from None
        run.trackers.log(row)


def save(run, step):
    args = run.args
    run.progress("checkpoint save", step, start_timeout(args))
    train_state = {
        "optimizer": run.optimizer.state_dict(),
        "dataloader": run.batches.states,
        "elapsed": run.elapsed,
        "rng": {
            "cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if run.device_type == "cuda" else None,
        },
    }
    meta = {
        "arch": run.plan.arch,
        "model_config": run.plan.config.to_dict(),
        **run.model.extra_meta(),
        "step": step,
        "tokens": step * run.plan.total_batch,
        "world_size": run.world_size,
        "fingerprints": run.record["fingerprints"],
        # the flags and plan this step was trained with: a resume's reference, config.json or not
        **{k: run.record[k] for k in resume.RUN_KEYS},
    }
    ckpt.save_checkpoint(run.run_dir, step, run.model, meta, train_state, run.rank)
    print0(f"saved checkpoint at step {step} in {run.run_dir}")


def forward_backward(run, timer):
    """The loss of one step's micro-batches, summed (on the device), and their gradients; (loss sum, last inputs)."""
    plan, batches = run.plan, run.batches
    loss_sum = torch.zeros((), device=run.device)
    for micro in range(plan.grad_accum):
        x, y = batches.take()  # packed ahead by MicroBatches' thread: "data" is the wait for one not ready yet
        timer.mark("data")
        sync = micro == plan.grad_accum - 1 or not run.is_ddp
        with contextlib.nullcontext() if sync else run.ddp.no_sync():
            loss = run.forward(x, y)
            loss_sum += loss.detach()
            (loss / plan.grad_accum).backward()
        timer.mark("fwd_bwd")
    return loss_sum, x


def optimizer_step(run, step, gate=None):
    """The update of `step` with the scheduled LR, momentum and decay (vetoed on the device where the 0-d bool
    `gate` is False); returns the LR multiplier."""
    lrm = lr_multiplier(step, run.plan)
    for group in run.optimizer.param_groups:
        group["lr"] = group["initial_lr"] * lrm
        if group["kind"] == "muon":
            group["momentum"] = momentum_at(step, run.plan)
            group["weight_decay"] = muon_weight_decay(step, run.plan, group["initial_weight_decay"])
    run.optimizer.step(gate)
    run.model.after_optimizer_step()
    run.model.zero_grad(set_to_none=True)
    return lrm


@dataclass
class Step:
    """What train_step hands back: the loss as a number (None: a step that logs no row reads nothing), whether a
    SIGTERM asks the run to stop, the LR multiplier, and the last micro-batch (telemetry)."""

    loss: float
    stopping: bool
    lrm: float
    x: torch.Tensor


def train_step(run, step, unlogged, stop_flag, timer):
    """Step `step` + 1: forward, backward, the finite check and the update, with at most one host read. The check's
    flags veto the update on the device, so a logged step reads them with its loss only once the update is queued;
    a step that logs no row hands them to the next step (unlogged: a Readback), which reads them once its own
    forward and backward are queued."""
    args, plan, model = run.args, run.plan, run.model
    model.set_tokens_seen(step * plan.total_batch)
    loss_sum, x = forward_backward(run, timer)
    stopping = False
    if (pending := unlogged.take()) is not None:  # the previous step's checks (it logged no row)
        values, (prev_step, names) = pending
        check_finite_late([values[0]] + values[2:], prev_step, names, args.log_every)
        stopping = values[1] > 0
    logged = stopping or run.writes_row(step + 1)  # a stop saves, and a save logs
    # the loss and SIGTERM in one all-reduce: every rank learns in the same step that one of them was asked to stop
    if run.stop.requested:
        stop_flag.fill_(1.0)  # a kernel, not a host-to-device copy: no sync with the work queued before it
    reduced = torch.stack([loss_sum, stop_flag])
    if run.is_ddp:
        dist.all_reduce(reduced)
        reduced[0] /= run.world_size
    train_loss = reduced[0] / plan.grad_accum
    flags = finite_flags(model, train_loss)  # the same on every rank: the loss and gradients are all-reduced
    checks, names = torch.cat([train_loss.reshape(1), reduced[1:], flags]), graded_names(model)
    timer.mark("sync_log")
    lrm = optimizer_step(run, step, gate=flags.all())
    timer.mark("optim")
    if not logged:
        unlogged.put(checks, (step + 1, names))
        return Step(None, stopping, lrm, x)
    values = step_timer.read_values(checks)  # the step's one host read: it waits for the update, queued above
    check_finite([values[0]] + values[2:], names, step + 1, origin=lambda: model.nonfinite_origin(x))
    return Step(values[0], stopping or values[1] > 0, lrm, x)


def step_row(run, step, train_loss, lrm, x):
    """A logged step's metrics row, before its evaluation and timings: loss, LR, data, the arch's own measures."""
    plan, args = run.plan, run.args
    row = {
        "step": step,
        "tokens": step * plan.total_batch,
        "flops": step * plan.total_batch * plan.flops_per_token,
        "train_loss": train_loss,
        "lr_mult": lrm,
    }
    # the packing's kept fraction on this rank's shards (the data budget assumes one: docs/reproduce.md), and the epoch
    states = run.batches.states
    read_into_rows = step * plan.grad_accum * args.device_batch_size * (args.max_seq_len + 1)
    dropped = sum(s.get("dropped_tokens", 0) for s in states)
    row.update(data_kept=read_into_rows / (read_into_rows + dropped), data_epoch=max(s["epoch"] for s in states))
    # e.g. MoD's realised skip rates and FLOPs since the last row (every rank pops its own)
    row.update(run.model.step_metrics())
    stats_line = None
    if run.rank == 0:
        stats, stats_line = arch_spec(plan.arch).telemetry(run.model, step, x, args)
        if stats is not None:
            row["gate"] = stats
    return row, stats_line


def log_row(run, row, steps, timer, intervals, stats_line):
    """A logged step's row completed with the time its `steps` took (tok/s, MFU, where the time went), printed and
    written. intervals: (steps, training seconds) of the rows so far, for the ETA."""
    plan, step = run.plan, row["step"]
    parts, wall = timer.read()
    train_seconds = wall - parts.get("eval", 0.0) - parts.get("save", 0.0)  # tok/s and elapsed as before: training only
    run.elapsed += train_seconds
    intervals.append((steps, train_seconds))
    recent = intervals[-20:]
    eta = (plan.num_iterations - step) * sum(t for _, t in recent) / sum(n for n, _ in recent)
    tok_per_sec = steps * plan.total_batch / train_seconds
    row.update(tok_per_sec=tok_per_sec, elapsed=run.elapsed, time=parts)
    mfu = None
    if run.peak_flops:
        mfu = plan.flops_per_token * tok_per_sec / (run.peak_flops * run.world_size)
        row["mfu"] = mfu
    print0(
        f"step {step:05d}/{plan.num_iterations:05d} ({100 * step / plan.num_iterations:5.1f}%) | loss "
        f"{row['train_loss']:.4f} | lrm {row['lr_mult']:.3f} | {tok_per_sec:,.0f} tok/s"
        + (f" | mfu {100 * mfu:.1f}%" if mfu is not None else "")
        + f" | {1000 * train_seconds / steps:.0f} ms | {biggest(parts)} | elapsed {fmt_time(run.elapsed)} "
        f"| eta {fmt_time(eta)}"
    )
    if stats_line:
        print0(stats_line)
    warning = overflow_warning(row.get("mod", {}))
    if warning and not run.overflow_warned:
        print0(warning)
        run.overflow_warned = True
    if "val_bpb" in row:
        print0(f"step {step:05d} | val bpb {row['val_bpb']:.4f}")
    write_row(run, row)


def train_loop(run):
    """Steps from run.start to the horizon. A logged step reads the loss (one host sync, after its update is queued);
    a step that logs no row reads nothing (Readback: its checks are read during the next step)."""
    args, plan, model = run.args, run.plan, run.model
    num_iterations = plan.num_iterations
    if run.start == 0:
        row = {
            "step": 0,
            "tokens": 0,
            "flops": 0,
            "train_loss": None,
            "lr_mult": lr_multiplier(0, plan),
            "tok_per_sec": None,
        }
        if run.evaluates(0):
            row["val_bpb"] = run_eval(run, 0)
            print0(f"step 0 | val bpb {row['val_bpb']:.4f}")
        write_row(run, row)

    step = run.start
    intervals = []  # (steps, training seconds) of each row: the ETA
    stop_flag = torch.zeros((), device=run.device)
    slow_step = True  # the first step compiles, a step after an evaluation may recompile: the start-up timeout
    # Where each row's time went (nanochat/step_timer.py): the parts of the interval since the previous row, which
    # also holds the checkpoint written after that row (a row goes out before its step's checkpoint, so that no
    # checkpoint lacks its row). Marks cost no sync; the timer is read where a logged step syncs anyway.
    timer = StepTimer(run.device)
    # A step that logs no row leaves its loss on the device and reads nothing: its non-finite check and SIGTERM flag
    # are copied to the host without waiting and read during the next step, once that step's work is queued. A
    # SIGTERM therefore stops the run one step later than on a logged step, whatever --log-every is.
    unlogged = Readback(run.device)
    last_row = run.start
    while step < num_iterations:
        run.progress(
            "the first step" if step == run.start else "a training step",
            step + 1,
            start_timeout(args) if slow_step else args.step_timeout,
        )
        done = train_step(run, step, unlogged, stop_flag, timer)
        step += 1
        slow_step = False
        if step == run.start + 1:
            freeze_heap()
            timer.mark("sync_log")
        if done.loss is None:
            continue
        stopping = done.stopping
        timer.mark("sync_log")
        row, stats_line = step_row(run, step, done.loss, done.lrm, done.x)
        timer.mark("sync_log")
        if run.evaluates(step):
            row["val_bpb"] = run_eval(run, step)
            timer.mark("eval")
            slow_step = True

        steps, last_row = step - last_row, step
        log_row(run, row, steps, timer, intervals, stats_line)
        timer.mark("sync_log")
        if stopping or run.saves(step):
            save(run, step)
            timer.mark("save")
            slow_step = True
        if stopping and step < num_iterations:
            print0(
                f"stopped by SIGTERM after step {step}: its checkpoint is complete; continue with --resume latest "
                f"(exit status {EXIT_PREEMPTED})"
            )
            finish(run, preempted=True)


def finish(run, preempted=False):
    if not preempted:
        if run.device_type == "cuda":
            print0(f"peak memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
        print0(f"done: {run.plan.num_iterations} steps in {fmt_time(run.elapsed)}; run directory {run.run_dir}")
        # said at the start too; a long log's end is where it is read
        if warning := run.record["attention"].get("warning"):
            print0(f"warning: {warning}")
    if run.watchdog:
        run.watchdog.stop()
    if run.is_ddp:
        dist.destroy_process_group()
    run.trackers.close()
    if preempted:
        sys.exit(EXIT_PREEMPTED)


def main(argv=None):
    with exit_on_user_error(
        NonFiniteError,
        interrupted="interrupted: every checkpoint written so far is complete; "
        "continue from the newest with --resume latest",
    ):
        return train(parse_args(argv), stated_flags(argv))


if __name__ == "__main__":
    main()
