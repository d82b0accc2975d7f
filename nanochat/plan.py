"""
What a run will do, worked out from its flags.

Model shape, batch, horizon, LR and weight-decay scale, schedules.

The plan is computed on the meta device (nothing allocated, no data read), so `base_train --dry-run`,
speedrun's planning and the depth sweep see exactly the numbers training will use.
Rules (docs/design.md §2): muP-style batch and LR scaling against the d12 reference at 2^19 tokens; the
horizon from --num-iterations, else --target-flops, else --target-param-data-ratio.
"""

import math
from dataclasses import dataclass

import torch

from nanochat.common import UserError, print0, check_run_name
from nanochat.gpus import GPU, PLANNED, gpu_here, gpu_named, gpu_of
from nanochat import memory
from nanochat.gpt import GPTConfig
from nanochat.optim import param_groups, POLAR_NORM_FACTOR, NORMUON_BETA2
from nanochat import tracking

REFERENCE_BATCH = 2**19  # tokens; the d12 reference of the muP-style batch rules
REFERENCE_DEPTH = 12
BATCH_EXPONENT = 0.383
MAX_DECAY_PER_STEP = 0.01
SAVES_PER_RUN = 5  # --save-every auto: about this many checkpoints before the last one
ASPECT_RATIO = 64  # model dim per layer when --model-dim is unset (nanochat's aspect ratio)
# the deepest model planned: 16 × the published 64 layers. A plan builds every layer (on the meta device, a few ms
# each), so --depth 100000 took minutes to print a plan; within this limit it comes in seconds.
MAX_DEPTH = 1024
MOMENTUM = {"start": 0.85, "peak": 0.97, "peak_step": 400, "end": 0.90}  # Muon momentum schedule of the published code
# wall-time estimates of a plan (speedrun, the depth sweep): 40% MFU of an H100's dense bf16 peak,
# evaluation not included
PLANNED_MFU = 0.40
PLANNED_PEAK = PLANNED.peak_flops  # the SXM part of an 8 × H100 node


def planned_seconds(total_flops, nproc, peak_flops=None):
    """Training seconds at PLANNED_MFU of peak_flops per GPU (default: the H100's)."""
    return total_flops / (nproc * (peak_flops or PLANNED_PEAK) * PLANNED_MFU)


@dataclass
class Target:
    """The GPU a plan is made for: its table entry (or None), the memory planned for, GiB (None: a CPU run, whose
    memory is not planned), and whether the model is compiled there."""

    gpu: GPU
    memory_gib: float
    compiled: bool

    @property
    def label(self):
        """What the plan calls the GPU: its name, with the memory planned for where that is not the card's."""
        if self.gpu and self.memory_gib == self.gpu.memory_gib:
            return self.gpu.label
        return f"{self.gpu.label if self.gpu else 'GPU'} with {self.memory_gib:g} GiB"

    def record(self):
        return {
            "gpu": self.gpu.name if self.gpu else None,
            "label": self.label if self.memory_gib else None,
            "memory_gib": self.memory_gib,
            "peak_flops": self.gpu.peak_flops if self.gpu else None,
        }


def plan_target(args, device_type=None, gpu_preset=False, default_gpu=None):
    """What the plan of these flags is made for. device_type: where the run trains (None: a plan only, for a GPU if
    --gpu / --gpu-memory or a GPU preset says so or one is here). --gpu NAME and --gpu-memory GIB override what the
    GPU here says; a plan without a GPU here is for default_gpu (a preset's), else the H100."""
    here = gpu_here()
    if device_type is None:
        wants_gpu = args.gpu or args.gpu_memory or gpu_preset or here
        device_type = args.device_type or ("cuda" if wants_gpu else "cpu")
    if device_type != "cuda" and not (args.gpu or args.gpu_memory):
        return Target(None, None, False)
    gpu, gib = None, None
    if args.gpu:
        gpu = gpu_named(args.gpu)
    elif device_type == "cuda" and here:
        gpu, gib = gpu_of(here[0]), here[1]
    else:
        gpu = gpu_named(default_gpu) if default_gpu else PLANNED
    gib = args.gpu_memory or gib or (gpu.memory_gib if gpu else None)
    return Target(gpu, gib, memory.compiles("cuda"))


def check_args(args):
    """Every value of base_train's flags that would crash later or train silently wrong, refused up front in one
    line."""
    tracking.parse_log_to(args.log_to)  # an unknown tracker or a missing package, before anything starts
    # the numbers (sizes, LRs, decays, horizons, intervals) were checked as they were parsed: nanochat/common.py's rule
    if not set(args.window_pattern) <= {"L", "S"} or not args.window_pattern:
        raise UserError(
            f"--window-pattern takes the letters L (full context) and S (half), got {args.window_pattern!r}"
        )
    if args.resume not in ("", "latest") and not args.resume.isdigit():
        raise UserError(f"--resume takes 'latest' or a step number, got {args.resume!r}")
    if args.change_settings and not args.resume:
        raise UserError("--change-settings only applies with --resume")
    if args.device_type not in ("", "cpu", "cuda", "mps"):
        raise UserError(f"--device-type must be cpu, cuda or mps (got {args.device_type!r})")
    if args.run is not None:
        check_run_name(args.run)
    if args.depth > MAX_DEPTH:
        raise UserError(
            f"--depth {args.depth} is beyond {MAX_DEPTH}, the deepest model planned (nanochat/plan.py MAX_DEPTH: 16 × "
            "the published 64 layers; a plan builds every layer, so a deeper one takes minutes to plan)"
        )
    if args.device_type == "cuda" and not torch.cuda.is_available() and not args.dry_run:
        raise UserError(
            "--device-type cuda, but torch sees no CUDA device here (use --device-type cpu, or a CUDA build of torch)"
        )


def model_config_from_args(args, vocab_size, depth=None):
    depth = depth or args.depth
    if args.model_dim > 0:
        dim = args.model_dim
    else:
        dim = args.depth * ASPECT_RATIO
        dim = -(-dim // args.head_dim) * args.head_dim
    if dim % args.head_dim:
        raise UserError(f"model dim {dim} is not a multiple of --head-dim {args.head_dim}")
    n_head = dim // args.head_dim
    n_kv = n_head if args.n_kv_head <= 0 else args.n_kv_head
    if n_head % n_kv:
        raise UserError(f"--n-kv-head {n_kv} must divide the number of heads {n_head}")
    if (dim // n_head) % 2:
        raise UserError(f"head dim {dim // n_head} must be even (rotary embeddings rotate pairs)")
    return GPTConfig(
        sequence_len=args.max_seq_len,
        vocab_size=vocab_size,
        n_layer=depth,
        n_head=n_head,
        n_kv_head=n_kv,
        n_embd=dim,
        window_pattern=args.window_pattern,
    )


@dataclass
class Plan:
    run: str
    arch: str
    config: GPTConfig
    model: torch.nn.Module  # on the meta device: nothing allocated
    optimizer_kwargs: dict  # the arch's own arguments of model.optimizer_groups
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
    device_batch: int
    target: Target
    memory: memory.Memory  # None where no GPU memory is planned

    def optimizer_groups(self, args):
        return self.model.optimizer_groups(
            args.embedding_lr,
            args.unembedding_lr,
            args.matrix_lr,
            self.weight_decay,
            self.lr_scale,
            **self.optimizer_kwargs,
        )

    def optimizer_record(self, args):
        """Every optimizer group's settings at step 0 and the schedules applied to them."""
        lrm0 = lr_multiplier(0, self)
        groups = []
        for g in param_groups(self.optimizer_groups(args)):
            row = {
                "name": g["name"],
                "kind": g["kind"],
                "num_params": sum(p.numel() for p in g["params"]),
                "lr": g["lr"],
                "lr_at_step0": g["lr"] * lrm0,
                "weight_decay": g["weight_decay"],
            }
            if g["kind"] == "adamw":
                row.update(betas=list(g["betas"]), eps=g["eps"])
            else:
                row.update(momentum_at_step0=momentum_at(0, self), normuon_beta2=g["beta2"])
            groups.append(row)
        momentum = dict(
            MOMENTUM, end_step=self.num_iterations, warmdown_start_step=self.num_iterations - self.warmdown_steps
        )
        return {
            "groups": groups,
            "muon_momentum": momentum,
            "muon_weight_decay": {
                "value": self.weight_decay,
                "rule": "weight_decay × √(B/2^19) × S_ref/S (capped at lr × wd ≤ 0.01)",
                "schedule": "cosine from value to 0 over the run",
            },
            "adamw_weight_decay": "constant",
            "polar_norm_factor": POLAR_NORM_FACTOR,
            "normuon_beta2": NORMUON_BETA2,
            "lr_schedule": {
                "warmup_steps": self.warmup_steps,
                "warmdown_steps": self.warmdown_steps,
                "final_lr_frac": args.final_lr_frac,
            },
        }

    def record(self, args):
        """The plan as plain JSON: the PLAN line of --dry-run and the body of config.json."""
        params = sum(p.numel() for p in self.model.parameters())
        return {
            "run": self.run,
            "arch": self.arch,
            "model_config": self.config.to_dict(),
            **self.model.extra_meta(),
            "num_params": params,
            "num_scaling_params": self.model.num_scaling_params(),
            "flops_per_token": self.flops_per_token,
            "num_iterations": self.num_iterations,
            "total_batch_size": self.total_batch,
            "grad_accum_steps": self.grad_accum,
            "world_size": self.nproc,
            "total_tokens": self.num_iterations * self.total_batch,
            "total_flops": self.flops_per_token * self.num_iterations * self.total_batch,
            "lr_scale": self.lr_scale,
            "weight_decay_effective": self.weight_decay,
            "save_every": self.save_every,
            "device_batch_size": self.device_batch,
            "gpu": self.target.record(),
            "memory": self.memory.record() if self.memory else None,
            "seed": args.seed,
            "data_seed": args.data_seed,  # null: the train data in file order
            "optimizer": self.optimizer_record(args),
            # fp32 weights + optimizer state (AdamW: 2 fp32 moments; Muon: 1 momentum + small variance)
            # ≈ 12-16 bytes/param
            "checkpoint_gib": params * 16 / 2**30,
        }


def make_plan(args, vocab_size, nproc, arch, model_class, init_kwargs, optimizer_kwargs, target=None):
    """The plan of checked flags (check_args) for a model class and its constructor / optimizer arguments
    (the caller's arch registry picks them from --arch), made for `target` (plan_target's; default: no GPU).
    --device-batch-size auto becomes a number here (args is updated): the largest power of two that fits the
    target's memory, or DEFAULT_BATCH where none is planned; a given one that does not fit is refused."""
    target = target or Target(None, None, False)
    config = model_config_from_args(args, vocab_size)
    with torch.device("meta"):
        model = model_class(config, **init_kwargs)
        # the reference of the batch and weight-decay rules: the d12 model of the same width and arch
        reference = model_class(model_config_from_args(args, vocab_size, depth=REFERENCE_DEPTH), **init_kwargs)
    size_ratio = model.num_scaling_params() / reference.num_scaling_params()  # S / S_ref
    flops_per_token = model.estimate_flops()
    T = args.max_seq_len
    batch = args.total_batch_size
    if batch <= 0:
        batch = 2 ** round(math.log2(REFERENCE_BATCH * size_ratio**BATCH_EXPONENT))
    rows = max(1, batch // (T * nproc))  # rows per process per optimizer step
    footprint, groups = None, None
    if target.memory_gib:
        footprint = memory.measure(
            model_class, model_class.kwargs_on("cuda", init_kwargs), config, args.fp8, target.compiled
        )
        groups = param_groups(model.optimizer_groups(1.0, 1.0, 1.0, 0.0, 1.0, **optimizer_kwargs))  # the state's shapes

    def memory_at(micro_batch):
        if footprint is None:
            return None
        accum = max(1, rows // micro_batch)
        return memory.plan_memory(
            model, groups, footprint, micro_batch, T, accum, nproc, target.memory_gib, target.compiled
        )

    def largest_fitting(batches):
        return next((b for b in sorted(batches, reverse=True) if memory_at(b).fits), None)

    device_batch = args.device_batch_size
    if device_batch == "auto":
        powers = [b for b in (2**k for k in range(11)) if b <= min(rows, memory.MAX_AUTO_BATCH) and rows % b == 0]
        powers = powers or [1]
        if footprint is None:
            device_batch = max(b for b in powers if b <= memory.DEFAULT_BATCH)
        else:
            device_batch = largest_fitting(powers)
            if device_batch is None:
                raise UserError(does_not_fit(memory_at(1), target, "even at device batch 1"))
        args.device_batch_size = device_batch
    elif footprint is not None and not memory_at(device_batch).fits:
        best = largest_fitting(2**k for k in range(int(math.log2(device_batch)) + 1))
        hint = f"the largest that fits is {best} (--device-batch-size {best}, or auto)" if best else "no batch fits"
        raise UserError(does_not_fit(memory_at(device_batch), target, f"at --device-batch-size {device_batch}; {hint}"))
    world_tokens = device_batch * T * nproc
    if args.total_batch_size <= 0:
        batch = max(1, round(batch / world_tokens)) * world_tokens  # whole micro-batches on every process
    if batch % world_tokens:
        raise UserError(
            f"--total-batch-size {batch} is not a multiple of device batch × seq len × processes = {world_tokens}"
        )
    if args.num_iterations > 0:
        steps = args.num_iterations
    elif args.target_flops > 0:
        steps = round(args.target_flops / (flops_per_token * batch))
    elif args.target_param_data_ratio > 0:
        steps = round(args.target_param_data_ratio * model.num_scaling_params() / batch)
    else:
        raise UserError("set one of --num-iterations, --target-flops, --target-param-data-ratio")
    if steps < 1:
        raise UserError(
            f"the budget gives {steps} steps at {batch} tokens per step; raise the budget or lower the batch"
        )
    lr_scale = math.sqrt(batch / REFERENCE_BATCH)
    weight_decay = args.weight_decay * lr_scale / size_ratio
    # far below the reference size the rule explodes (S_ref/S ~ 1e3 on a CPU demo): never shrink
    # the matrices by more than MAX_DECAY_PER_STEP in one step
    max_wd = MAX_DECAY_PER_STEP / (args.matrix_lr * lr_scale)
    if weight_decay > max_wd:
        print0(
            f"note: the weight-decay rule gives {weight_decay:.3g} for this small model; capped to {max_wd:.3g} "
            f"(lr × wd ≤ {MAX_DECAY_PER_STEP} per step)"
        )
        weight_decay = max_wd
    # warm-up and warm-down never overlap: the warm-up is cut to the steps before the warm-down
    warmdown = round(args.warmdown_ratio * steps)
    warmup = min(args.warmup_steps, steps - warmdown)
    save_every = args.save_every if args.save_every >= 0 else math.ceil(steps / SAVES_PER_RUN)
    return Plan(
        run=args.run or f"{arch}-d{args.depth}",
        arch=arch,
        config=config,
        model=model,
        optimizer_kwargs=optimizer_kwargs,
        nproc=nproc,
        total_batch=batch,
        grad_accum=batch // world_tokens,
        num_iterations=steps,
        lr_scale=lr_scale,
        weight_decay=weight_decay,
        warmup_steps=warmup,
        warmdown_steps=warmdown,
        final_lr_frac=args.final_lr_frac,
        save_every=save_every,
        flops_per_token=flops_per_token,
        device_batch=device_batch,
        target=target,
        memory=memory_at(device_batch),
    )


def does_not_fit(mem, target, where):
    own = target.gpu and target.label == target.gpu.label  # not --gpu-memory's figure
    space = f"the {target.label}'s {target.memory_gib:.1f} GiB" if own else f"{target.memory_gib:g} GiB"
    return (
        f"the run does not fit {space} {where}: it needs {mem.needed:.1f} GiB "
        f"(peak {mem.peak:.1f}: activations {mem.activations:.1f}, readout {mem.readout:.1f}, weights, gradients "
        f"and optimizer {mem.weights + mem.gradients + mem.optimizer:.1f}; docs/memory.md)"
    )


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


def momentum_at(step, plan):
    return muon_momentum(step, plan.num_iterations, plan.warmdown_steps)


def muon_weight_decay(step, plan, initial):
    """Muon's decay at `step`: cosine from its initial value to 0 over the run."""
    return initial * 0.5 * (1 + math.cos(math.pi * step / plan.num_iterations))
