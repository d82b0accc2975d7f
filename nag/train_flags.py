"""base_train's command line: its flags, grouped by what they decide, and a preset placed before them.

A library module, not a command, so that the drivers (speedrun, the experiments) and the benchmarks read a run's
flags the way base_train does without importing base_train. Every flag of base_train's own changes what a run
learns or is an operational need on a real node; each arch's own flags come from nag/archs.py.
"""

import argparse

from nanochat.common import (
    START_TIMEOUT,
    auto_or,
    positive,
    fraction,
    non_negative,
    non_negative_or_unset,
    parse_checked,
    positive_float,
    positive_int,
    positive_or_unset,
    script_argv,
)
from nanochat.flash_attention import CHOICES as ATTN_CHOICES
from nanochat.gpus import BY_NAME as GPU_NAMES
from nanochat.gpt import OPTIMIZER_DEFAULTS
from nanochat.plan import ASPECT_RATIO, SAVES_PER_RUN
from nag.archs import ARCHS, add_arch_args
from nag.presets import PRESETS, preset_args

DRY_RUN_VOCAB = 32768  # --dry-run without a preset: the vocab of the default tokenizer (scripts.tok_train)


def add_run_args(p):
    g = p.add_argument_group("run: what trains, under which name")
    g.add_argument(
        "--preset",
        type=str,
        default="",
        help=f"a named configuration ({', '.join(PRESETS)}; nag/presets.py); later flags override it",
    )
    g.add_argument("--arch", type=str, default="gpt", help=f"one of {', '.join(ARCHS)} (nag/archs.py)")
    g.add_argument(
        "--run",
        type=str,
        default=None,
        help="run name (one directory under $NANOCHAT_BASE_DIR/runs) or a directory path; default <arch>-d<depth>",
    )
    g.add_argument("--seed", type=int, default=42, help="seed of the initialisation")
    g.add_argument(
        "--data-seed",
        type=int,
        default=None,
        help="seed of the order the train documents are read in (row groups shuffled per epoch; default: file order)",
    )


def add_model_args(p):
    g = p.add_argument_group("model: its shape")
    g.add_argument("--depth", type=positive_int, default=20)
    g.add_argument(
        "--model-dim",
        type=positive_or_unset(int, f"depth × {ASPECT_RATIO}"),
        default=-1,
        help=f"model dim (-1: depth × {ASPECT_RATIO}, rounded up to a multiple of --head-dim)",
    )
    g.add_argument("--head-dim", type=positive_int, default=128)
    g.add_argument(
        "--n-kv-head",
        type=positive_or_unset(int, "every query head its own"),
        default=-1,
        help="GQA key/value heads (-1: as many as query heads)",
    )
    g.add_argument("--max-seq-len", type=positive_int, default=2048)
    g.add_argument(
        "--window-pattern", type=str, default="L", help="per-layer attention windows, cycled: L full, S half"
    )
    g.add_argument(
        "--fp8",
        action="store_true",
        help=(
            "fp8 matmuls in training for the linear layers the size rule admits "
            "(nanochat/fp8.py; CUDA 8.9+, or the CPU in an fp32 twin)"
        ),
    )


def add_horizon_args(p):
    g = p.add_argument_group("horizon and batch (of the horizon flags, the first one set wins)")
    g.add_argument(
        "--num-iterations",
        type=positive_or_unset(int, "the horizon from --target-flops or --target-param-data-ratio"),
        default=-1,
        help="optimizer steps (-1: from --target-flops, else --target-param-data-ratio)",
    )
    g.add_argument(
        "--target-flops", type=positive_or_unset(float, "unset"), default=-1.0, help="training FLOPs (-1: unset)"
    )
    g.add_argument(
        "--target-param-data-ratio",
        type=positive_or_unset(float, "unset"),
        default=10.5,
        help="training tokens per scaling parameter (-1: unset)",
    )
    g.add_argument(
        "--device-batch-size",
        type=auto_or(positive_int),
        default="auto",
        help="rows per micro-batch; auto: the largest power of two that fits the GPU's memory (nanochat/memory.py), "
        "with gradient accumulation keeping the total batch",
    )
    g.add_argument(
        "--total-batch-size",
        type=positive_or_unset(int, "set from the model size"),
        default=-1,
        help="tokens per optimizer step (-1: set from the model size)",
    )


def add_optimizer_args(p):
    d = OPTIMIZER_DEFAULTS
    g = p.add_argument_group("optimizer: LRs (scaled by the batch rule), decay, schedule (docs/optimizer.md)")
    g.add_argument("--embedding-lr", type=positive_float, default=d["embedding_lr"])
    g.add_argument("--unembedding-lr", type=positive_float, default=d["unembedding_lr"])
    g.add_argument("--matrix-lr", type=positive_float, default=d["matrix_lr"])
    g.add_argument(
        "--weight-decay",
        type=non_negative(float, "no weight decay"),
        default=d["weight_decay"],
        help="Muon weight decay at the d12 reference (scaled by √(B/2^19)·S_ref/S; 0: none)",
    )
    g.add_argument(
        "--warmup-steps",
        type=non_negative(int, "no warm-up"),
        default=40,
        help="LR warm-up steps (0: none); capped so it ends before the warm-down starts",
    )
    g.add_argument(
        "--warmdown-ratio", type=fraction(), default=0.65, help="share of the steps in the LR warm-down, in [0, 1]"
    )
    g.add_argument(
        "--final-lr-frac", type=fraction(), default=0.05, help="the LR at the end, a fraction of the peak, in [0, 1]"
    )


def add_evaluation_args(p):
    g = p.add_argument_group("evaluation during training")
    g.add_argument(
        "--eval-every",
        type=positive_or_unset(int, "never evaluates"),
        default=250,
        help="val bpb every N steps and at the end; -1 = never",
    )
    g.add_argument(
        "--eval-tokens",
        type=positive_int,
        default=10 * 2**19,
        help="val tokens per evaluation (capped at what the split holds)",
    )


def add_operations_args(p):
    g = p.add_argument_group("operations: device, checkpoints, logging, resuming, timeouts")
    g.add_argument(
        "--device-type",
        type=str,
        default="",
        help="cuda|cpu|mps (default: autodetect); compiled on cuda (TORCH_COMPILE_DISABLE=1 runs it eagerly)",
    )
    g.add_argument(
        "--gpu",
        choices=list(GPU_NAMES),
        default=None,
        help="plan for this GPU (memory, time, MFU) instead of the one torch sees (default: it; in a dry run "
        "without one: h100)",
    )
    g.add_argument(
        "--gpu-memory",
        type=positive(float),
        default=None,
        help="plan for a GPU of this many GiB (default: --gpu's, else the GPU's own)",
    )
    g.add_argument(
        "--attn",
        type=str,
        default="auto",
        choices=list(ATTN_CHOICES),
        help=(
            "attention kernel: auto = on Hopper the fastest of sdpa and each of cudnn, fa4, fa3 that loads, timed at "
            "start (docs/design.md §2); elsewhere SDPA"
        ),
    )
    g.add_argument(
        "--save-every",
        type=non_negative_or_unset(int, f"about {SAVES_PER_RUN} per run", zero="the last step only"),
        default=-1,
        help=f"checkpoint every N steps (-1: auto, ~{SAVES_PER_RUN} per run; 0: the last step only)",
    )
    g.add_argument(
        "--log-every",
        type=positive_int,
        default=1,
        metavar="N",
        help="a metrics row and a training line every N steps (and at evaluations, saves and the end); "
        "the steps between read nothing from the device",
    )
    g.add_argument(
        "--log-to",
        type=str,
        default="",
        metavar="KINDS",
        help="also send every metrics row to tensorboard, wandb and/or trackio, comma-separated "
        "(the [track] extra; docs/interop.md §5)",
    )
    g.add_argument(
        "--resume",
        type=str,
        default="",
        help="'latest' (newest complete checkpoint; starts the run if it has none) or a step",
    )
    g.add_argument(
        "--change-settings",
        action="store_true",
        help="with --resume: accept settings that differ from the run's (the horizon included), recorded in "
        "config.json's segments from this step on",
    )
    g.add_argument(
        "--step-timeout",
        type=positive_float,
        default=300,
        help="several processes: seconds a rank may wait for the others in a training step before the run "
        f"stops, naming the silent ranks (start-up, evaluations and saves: at least {START_TIMEOUT})",
    )
    g.add_argument(
        "--dry-run",
        type=non_negative(int, "train"),
        default=0,
        metavar="NPROC",
        help="print the plan for NPROC processes (params, FLOPs, steps, tokens, optimizer) and exit; needs no "
        f"data or GPU (vocab: the preset's, else {DRY_RUN_VOCAB:,}); 0: train",
    )


def build_parser():
    p = argparse.ArgumentParser(description="Pretrain a GPT or NAG base model.")
    for add in (
        add_run_args,
        add_model_args,
        add_horizon_args,
        add_optimizer_args,
        add_evaluation_args,
        add_operations_args,
        add_arch_args,
    ):
        add(p)
    return p


def parse_args(argv=None):
    """Flags of a --preset first, then the command line, so that later flags win."""
    argv = script_argv(argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--preset", default="")
    pre.add_argument("--arch", default="gpt")
    known, _ = pre.parse_known_args(argv)
    return parse_checked(build_parser(), preset_args(known.preset, known.arch) + argv)


def stated_flags(argv=None):
    """The flags a command line gives itself, not its preset's nor the defaults (their dests): on a resume, every
    setting it leaves out is the run's (nanochat/resume.py continued_args)."""
    parser = build_parser()
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return frozenset(vars(parser.parse_args(script_argv(argv))))


def start_timeout(args):
    """Seconds for start-up (data, compile, the first step), evaluations and saves: slower than a step."""
    return max(START_TIMEOUT, args.step_timeout)
