"""
speedrun.sh's planner: its flags, every run's plan, disk and GPU checks, and the stages done.

speedrun.sh runs `python -m scripts.speedrun --plan-file FILE "$@"`: the plan and the status go to stderr for the
user, and FILE (a temporary file of speedrun.sh's) receives the plan as data for the script: plain assignments of
scalars and bash arrays, every value shell-quoted, which speedrun.sh sources (write_plan_file). Nothing is written
to stdout, and no shell code is generated: a line of base_train's output can never become a command.

    python -m scripts.speedrun --dry-run                 # the plan of the published pair, for 8 GPUs
    python -m scripts.speedrun --preset tiny --dry-run   # the CPU smoke test

--arch names the runs: gpt and nag are the preset's pair (its baseline and its NAG run; run6's pair is gpt-recipe
and nag-recipe), and any other arch of nag/archs.py trains beside them under its own name. With --seeds 1,2,3 every
arch trains once per seed (<run>-s1, ...), and the report compares the pair's two groups. --help prints the usage
and writes no plan, so speedrun.sh stops there. Paths (--base-dir, --eval-bundle, $NANOCHAT_BASE_DIR) are the
caller's: relative to $NANOCHAT_CALLER_CWD, which speedrun.sh and the runs/ scripts set to the directory they were
started from before they cd to the repo root.
"""

import argparse
import contextlib
import hashlib
import json
import math
import os
import re
import shlex
import shutil
import sys
import time

from nanochat.common import (
    UserError,
    exit_on_user_error,
    caller_path,
    base_dir_path,
    parse_checked,
    parse_seeds,
    positive,
    positive_int,
    non_negative,
    seed_flags,
    cuda_problem,
    nvidia_smi,
)
from nanochat import checkpoint_manager as ckpt
from nanochat.run_dir import EVAL_JSON, folder_name, read_eval, run_path
from nanochat.tokenizer import get_tokenizer_dir, has_tokenizer
from nanochat.dataset import MAX_SHARD, PACKING_KEPT, SHARD_MB, TOKENS_PER_SHARD, expected_epochs, shards_for
from nanochat.plan import PLANNED_MFU, planned_seconds
from nanochat.gpus import BY_NAME as GPUS
from nanochat.resume import HORIZON
from nanochat.gpt import GPT
from nag.archs import ARCHS, NOT_SETTINGS, is_nag_arch, plan_for
from nag.model import NAGGPT
from nag.presets import PRESETS, get_preset, pair_arch
from nag import train_flags
from analysis.compare.inputs import report_is_current

# --arch's words for the preset's pair, baseline first: each names the run of that role, whose arch the preset's
# "pair" gives (nag/presets.py pair_arch), and is the name of the arch it trains without one: the plain GPT and NAG.
# Any other arch --arch names comes from nag/archs.py and trains beside the pair.
ROLES = (GPT.arch, NAGGPT.arch)
SEED_FLAGS = seed_flags(0)[::2]  # the base_train flags a seed sets (nanochat.common.seed_flags): --seeds owns them
# the speedrun flag that sets a base_train flag of every run, where their names differ (check_extra)
SET_BY = {"--run": "--tag", "--target-flops": "--flops", **dict.fromkeys(SEED_FLAGS, "--seeds")}
TOK_SHARDS = 8
TOKENIZER_CHARS = {"tiny": 2_000_000}  # default 2B characters
# base_train flags that change how a run is saved, logged or computed, not what it learns (nanochat/resume.py's list
# and the archs'): they add nothing to the tag derived from the flags after `--`, so a rerun with another checkpoint
# period finds the same runs. speedrun sets the others of that list itself; the horizon changes what a run learns.
SPEEDRUN_SETS = {"run", "resume", "dry_run", "preset", "device_type"}
UNNAMED_FLAGS = {f"--{k.replace('_', '-')}" for k in NOT_SETTINGS - HORIZON - SPEEDRUN_SETS} | {"--no-compile"}
# Set for every torchrun launch. torch shares the rendezvous TCP store between torchrun's agent and the workers by
# default, and a restart after a lost worker can then connect to the previous round's peers and fail or hang
# (pytorch/pytorch#135712); with a store of the workers' own, every restart in our trials resumed (docs/LOG.md).
LAUNCH_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
NODE_WAIT_S = 2 * 3600  # how long nodes other than node 0 wait for its data and tokenizer
MAX_TAG = 40


def build_parser():
    p = argparse.ArgumentParser(
        prog="speedrun.sh",
        description="FLOP-matched GPT vs NAG: data, tokenizer, training, CORE + bpb, report.",
        epilog="Anything after -- goes to base_train (python -m scripts.base_train --help). Relative paths are taken "
        "from the directory the command runs in. Rerunning skips finished stages.",
    )
    p.add_argument("--preset", default="published", help=f"one of {', '.join(PRESETS)}")
    p.add_argument(
        "--arch",
        default=",".join(ROLES),
        help=f"which runs: {', '.join(ROLES)} or {','.join(ROLES)}, the preset's pair (the baseline "
        "trains first; run6's pair is gpt-recipe, nag-recipe); any other arch of nag/archs.py trains "
        "beside them",
    )
    p.add_argument(
        "--flops",
        type=positive(float),
        default=None,
        help="override the FLOP budget of every run (a preset with several budgets, like pilot: train this one)",
    )
    p.add_argument(
        "--gpus",
        type=positive_int,
        default=None,
        help="processes (default: every visible GPU; 8 in --dry-run without GPUs; 1 for tiny)",
    )
    p.add_argument(
        "--tag",
        default="",
        help="run names become <arch>-<preset>-<tag> (default: derived from the base_train flags after --)",
    )
    p.add_argument(
        "--seeds",
        default=None,
        help="comma-separated seeds, e.g. 1,2,3: every arch once per seed, named <run>-s<seed>, with "
        f"{' and '.join(SEED_FLAGS)} set from it; the report compares the groups",
    )
    p.add_argument(
        "--nnodes",
        type=positive_int,
        default=1,
        help="nodes, each running this command with its --node-rank (docs/runs.md)",
    )
    p.add_argument(
        "--node-rank",
        type=non_negative(int, "node 0"),
        default=0,
        help="this node's rank, 0 .. nnodes-1: node 0 fetches data, evaluates, reports",
    )
    p.add_argument(
        "--rdzv-endpoint",
        default="",
        help="with --nnodes > 1: HOST:PORT of node 0, where every run's torchrun rendezvous meets",
    )
    p.add_argument(
        "--max-restarts",
        type=non_negative(int, "no restart"),
        default=2,
        help="torchrun restarts of a training run after a lost worker (it resumes)",
    )
    p.add_argument(
        "--base-dir",
        default=None,
        help="everything goes here (default $NANOCHAT_BASE_DIR or ~/.cache/nanochat); several nodes: one "
        "directory every node sees",
    )
    p.add_argument(
        "--shards", type=positive_int, default=None, help="ClimbMix train shards to download (default: from the budget)"
    )
    p.add_argument(
        "--gpu",
        choices=list(GPUS),
        default=None,
        help="plan for this GPU (memory, hours) and give it to every run (default: the GPUs here; in a dry run "
        "without one, the preset's: h100, or rtx5090 for pilot)",
    )
    p.add_argument(
        "--gpu-memory", type=positive(float), default=None, help="plan every run for GPUs of this many GiB"
    )
    p.add_argument("--offline", action="store_true", help="build the offline corpus instead of downloading ClimbMix")
    p.add_argument("--eval-bundle", default="", help="a local CORE bundle (default: downloaded once into the base dir)")
    p.add_argument("--dry-run", action="store_true", help="the plan only: nothing is downloaded, trained or written")
    p.add_argument("--plan-file", default=None, help=argparse.SUPPRESS)  # speedrun.sh's: where the plan goes
    return p


def derived_tag(extra):
    """A readable, stable tag for the base_train flags after `--`: `--nag-mod-floor 0 --depth 32` gives
    nag-mod-floor0_depth32; a long one keeps its start and adds a hash of the whole. Flags that do not change
    what a run learns (UNNAMED_FLAGS) are left out; "" when nothing is left."""
    groups = []
    for a in extra:
        if a.startswith("--") or not groups:
            groups.append(a.split("=", 1))
        else:
            groups[-1].append(a)
    groups = [g for g in groups if g[0] not in UNNAMED_FLAGS]
    if not groups:
        return ""
    words = []
    for name, *values in groups:
        word = name.lstrip("-")
        for v in values:  # a number joins its flag (nag-mod-floor0), a word takes a dash (nag-renorm-predicted)
            word += v if v[:1].isdigit() or v[:1] in ".-" else "-" + v
        words.append(word)
    tag = re.sub(r"[^A-Za-z0-9._-]+", ".", "_".join(words)).strip("._-") or "extra"
    if len(tag) > MAX_TAG:
        digest = hashlib.sha1("\0".join(a for g in groups for a in g).encode()).hexdigest()[:8]
        tag = tag[: MAX_TAG - len(digest) - 1].rstrip("._-") + "-" + digest
    return tag


def parse_archs(text, preset):
    """--arch: the pair's roles present (baseline first, whatever the order given), then any other registered arch."""
    archs = list(dict.fromkeys(a for a in text.split(",") if a))
    bad = [a for a in archs if a not in ROLES and a not in ARCHS]
    if bad:
        raise UserError(
            f"unknown arch {bad[0]!r} in --arch {text} (expected {', '.join(ROLES)} or an arch of "
            f"nag/archs.py: {', '.join(ARCHS)})"
        )
    if not archs:
        raise UserError(f"--arch is empty (expected {', '.join(ROLES)} or {','.join(ROLES)})")
    archs = [r for r in ROLES if r in archs] + [a for a in archs if a not in ROLES]
    trained = [pair_arch(preset, a) for a in archs]
    if len(set(trained)) < len(trained):  # run6's gpt is gpt-recipe: the two would be one run
        raise UserError(f"--arch {text} names one arch twice with --preset {preset} ({', '.join(trained)})")
    return archs


def given_flags(argv):
    """The base_train flags that argv sets, in order, as base_train reads them (abbreviated, or as --flag=value)."""
    p = train_flags.build_parser()
    names = {}
    for action in p._actions:  # only the flags given land in the namespace
        action.default = argparse.SUPPRESS
        names[action.dest] = next((o for o in action.option_strings if o.startswith("--")), action.dest)
    return [names[dest] for dest in vars(parse_checked(p, argv))]


def check_extra(args):
    """The one rule of the base_train flags after `--`: none that speedrun writes on every run's command line itself
    (train_args: --preset, --arch, --run and --resume; --target-flops with --flops; the seed's flags with --seeds).
    Given there too, it would win for every run, under a plan, a header and run names that say speedrun's value."""
    own = argparse.Namespace(**{**vars(args), "extra": []})
    written = given_flags(train_args(own, *runs(own)[0]))
    clash = [f for f in given_flags(args.extra) if f in written]
    if not clash:
        return
    if clash[0] == "--resume":
        raise UserError(
            "speedrun gives every run --resume latest (a rerun continues it); drop --resume from the base_train "
            "flags after --"
        )
    owner = SET_BY.get(clash[0], clash[0])
    sets = " and ".join(f for f in written if SET_BY.get(f, f) == owner)
    raise UserError(
        f"speedrun's {owner} sets {sets} of every run; drop {clash[0]} from the base_train flags after -- and give "
        f"speedrun's {owner} (before --) instead"
    )


def parse(argv):
    """speedrun flags, then base_train flags after `--`."""
    argv = list(argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parse_checked(build_parser(), argv[: len(argv) - len(extra) - (1 if "--" in argv else 0)])
    args.extra = extra
    args.derived_tag = "" if args.tag else derived_tag(extra)  # extras change the runs: they need names of their own
    args.tag = args.tag or args.derived_tag
    budgets = get_preset(args.preset).get("budgets")
    args.every_budget = bool(budgets) and args.flops is None  # a dry run plans them all; a run trains the first
    args.flops = args.flops or (budgets[0] if budgets else None)
    args.archs = parse_archs(args.arch, args.preset)
    if args.seeds is not None:
        args.seeds = parse_seeds(args.seeds)
    if args.node_rank >= args.nnodes:
        raise UserError(f"--node-rank must be in 0..nnodes-1 (0..{args.nnodes - 1}); got {args.node_rank}")
    if args.nnodes > 1 and not re.fullmatch(r"[^\s:]+:\d+", args.rdzv_endpoint):
        raise UserError(
            f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT (node 0's address and a free port), "
            f"got {args.rdzv_endpoint!r}"
        )
    if args.tag and not all(c.isalnum() or c in "._-" for c in args.tag):
        raise UserError(f"--tag may hold only letters, digits, '.', '_' and '-', got {args.tag!r}")
    check_extra(args)
    if args.eval_bundle:
        if not os.path.isdir(caller_path(args.eval_bundle)):
            raise UserError(f"--eval-bundle {caller_path(args.eval_bundle)} is not a directory")
        args.eval_bundle = caller_path(args.eval_bundle)
    args.base_dir = base_dir_path(args.base_dir)
    args.offline = args.offline or args.preset == "tiny" or os.environ.get("NANOCHAT_OFFLINE") == "1"
    return args


def run_name(args, arch, seed=None):
    """arch: a role of the pair (the name holds the preset's arch of that role, its "pair") or an arch of its own."""
    budget = f"-{budget_word(args.flops)}" if get_preset(args.preset).get("budgets") else ""
    return (
        f"{pair_arch(args.preset, arch)}-{args.preset}{budget}"
        + (f"-{args.tag}" if args.tag else "")
        + (f"-s{seed}" if seed is not None else "")
    )


def budget_word(flops):
    """A FLOP budget in a run name: 1e18, 3e18, 2.5e18."""
    mantissa, exponent = f"{flops:e}".split("e")
    return f"{float(mantissa):g}e{int(exponent)}"


def runs(args):
    """(arch, seed) of every run in training order: for each seed the pair's baseline, its NAG run, then any other
    arch; seed None without --seeds."""
    return [(arch, seed) for seed in (args.seeds or [None]) for arch in args.archs]


def has_pair(args):
    """Whether both runs of the pair train: the analysis and the report compare them."""
    return all(r in args.archs for r in ROLES)


def flops_args(args):
    return ["--target-flops", f"{args.flops:g}"] if args.flops else []


def memory_args(args):
    """The memory plan's flags of every run: the GPU planned for, and the device batch the runs share when the plan
    would give them different ones (pair_batch)."""
    memory = ["--gpu-memory", f"{args.gpu_memory:g}"] if args.gpu_memory else []
    batch = ["--device-batch-size", str(args.pair_batch)] if getattr(args, "pair_batch", None) else []
    return (["--gpu", args.gpu] if args.gpu else []) + memory + batch


def bundle_args(args):
    return ["--eval-bundle", args.eval_bundle] if args.eval_bundle else []


def train_args(args, arch, seed=None):
    """The base_train command line of one run, as speedrun.sh writes it: the seed's flags (seed_flags) after the user's
    flags, the run's own --run and --resume last, so they win."""
    return [
        "--preset",
        args.preset,
        "--arch",
        pair_arch(args.preset, arch),
        *flops_args(args),
        *memory_args(args),
        *args.extra,
        *seed_flags(seed),
        "--run",
        run_name(args, arch, seed),
        "--resume",
        "latest",
    ]


def eval_args(args, arch, seed=None):
    """The base_eval command line of one run, as speedrun.sh writes it."""
    return [
        "--run",
        run_name(args, arch, seed),
        "--eval",
        "core,bpb,sample",
        *get_preset(args.preset)["eval"],
        *bundle_args(args),
    ]


def plans(args, vocab, gpus):
    """base_train's plan record of every run, keyed by run name, in training order."""
    out = {}
    for arch, seed in runs(args):
        train = train_flags.parse_args(train_args(args, arch, seed))
        out[run_name(args, arch, seed)] = plan_for(train, vocab, gpus).record(train)
    return out


def arch_runs(args, arch):
    """The run names of one arch, in seed order."""
    return [run_name(args, arch, seed) for seed in (args.seeds or [None])]


def report_dir(args):
    """speedrun's own report folder (compare's --out): with one run per arch the pair's, with several seeds the
    groups'."""
    a, b = (arch_runs(args, r) for r in ROLES)
    if len(a) == 1:
        return os.path.join(args.base_dir, "reports", f"{a[0]}_vs_{b[0]}")
    seeds = "seeds-" + "-".join(map(str, args.seeds))
    a, b = (run_name(args, r) for r in ROLES)
    return os.path.join(args.base_dir, "reports", f"{a}-{seeds}_vs_{b}-{seeds}")


def compared_runs(args):
    """scripts.compare's runs, as speedrun.sh passes them with --out REPORT: the pair, or with several seeds group a
    (the baseline's runs) against group b (NAG's)."""
    a, b = (arch_runs(args, r) for r in ROLES)
    return [*a, *b] if len(a) == 1 else ["--a", *a, "--b", *b]


def launch_command(gpus, nnodes=1, max_restarts=2, endpoint=""):
    """How speedrun starts a training run: one process as is; several under torchrun, which restarts them all when one
    is lost (base_train --resume latest then continues from the newest checkpoint); several nodes meet at the
    c10d rendezvous on node 0 (one per run: the run's torchrun on every node joins the same one)."""
    if gpus == 1 and nnodes == 1:
        return ["python", "-m"]
    where = (
        ["--standalone"]
        if nnodes == 1
        else [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", "--rdzv-id=nanochat"]
    )
    return ["torchrun", *where, f"--nproc_per_node={gpus}", f"--max-restarts={max_restarts}", "-m"]


def wait_for_node0(args, records):
    """Nodes other than node 0 train only: they wait until node 0 has the data and the tokenizer in the shared base
    dir."""
    waited, say = 0, lambda *a: print(*a, file=sys.stderr, flush=True)
    while True:
        done = status(args, records)
        if done["data"] and done["tokenizer"]:
            return
        if waited >= NODE_WAIT_S:
            raise UserError(
                f"node {args.node_rank}: node 0 has not prepared the data and tokenizer in {args.base_dir} "
                f"after {NODE_WAIT_S // 3600} h; is node 0 running, and is the base dir shared?"
            )
        if waited % 300 == 0:
            say(
                f"node {args.node_rank}: waiting for node 0's data and tokenizer in {args.base_dir} "
                f"({waited // 60} min so far)"
            )
        time.sleep(30)
        waited += 30


def newer(a, b):
    return os.path.exists(a) and os.path.exists(b) and os.path.getmtime(a) >= os.path.getmtime(b)


def eval_path(run_dir):
    return os.path.join(run_dir, EVAL_JSON)  # its mtime, against the final checkpoint's: nanochat.run_dir names it


def status(args, plan_records):
    """Which stages are already done (each is skipped on a rerun): data, tokenizer, each run's training and
    evaluation, and with the pair the analysis of the first seed's pair and the report of the pair's runs."""
    base = args.base_dir
    data = os.path.join(base, "base_data")
    if args.offline:
        data_done = os.path.isdir(data) and any(f.startswith("shard_") for f in os.listdir(data))
    else:
        data_done = all(
            os.path.exists(os.path.join(data, f"shard_{i:05d}.parquet"))
            for i in [*range(args.shards_needed), MAX_SHARD]
        )
    done = {"data": data_done, "tokenizer": has_tokenizer(base)}
    for run, p in plan_records.items():
        run_dir = run_path(run, base)
        final = ckpt.model_path(run_dir, p["num_iterations"])
        done[f"train {run}"] = os.path.isdir(run_dir) and ckpt.is_complete(run_dir, p["num_iterations"])
        # evaluated after the final checkpoint, and not a CORE cut short (the rerun's base_eval resumes it)
        done[f"eval {run}"] = (
            done[f"train {run}"]
            and newer(eval_path(run_dir), final)
            and (read_eval(run_dir) or {}).get("core_finished") is not False
        )
    if not has_pair(args):
        return done
    pair = [arch_runs(args, r)[0] for r in ROLES]  # the analysis: the first seed's pair
    evals = [eval_path(run_path(r, base)) for r in pair]
    # python -m analysis names its folder by the runs and the steps it analysed: their final ones
    folder = "analysis_" + folder_name([(r, plan_records[r]["num_iterations"]) for r in pair])
    analysis = os.path.join(base, "reports", folder, "analysis.json")
    done["analysis"] = all(done[f"eval {r}"] for r in pair) and all(newer(analysis, e) for e in evals)
    # the runs in compare's order (the baseline's, then NAG's, each in seed order): the order its inputs.json records
    compared = [run_path(r, base) for a in ROLES for r in arch_runs(args, a)]
    current = report_is_current(report_dir(args), compared)
    if args.seeds and len(args.seeds) > 1:  # the group report links no analysis
        done["report"] = all(done[f"eval {r}"] for a in ROLES for r in arch_runs(args, a)) and current
    else:  # the pair's report links the analysis: made after it
        done["report"] = done["analysis"] and newer(os.path.join(report_dir(args), "report.md"), analysis) and current
    return done


def hms(s):
    return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"


def gpus_and_vocab(args):
    """(GPUs per node, the preset's vocab), after the checks that need neither data nor a plan: GPUs that torch sees,
    a reused tokenizer of the preset's size."""
    have = nvidia_smi()[0]  # GPUs listed; whether torch sees them is cuda_problem's check
    gpus = args.gpus or (1 if args.preset == "tiny" else have)
    if not gpus:
        if not args.dry_run:
            raise UserError(
                "no NVIDIA GPU found (nvidia-smi); see the plan with --dry-run, or smoke-test on CPU with --preset tiny"
            )
        gpus = get_preset(args.preset).get("gpus", 8)
    if not args.dry_run and args.preset != "tiny":  # nvidia-smi may list GPUs that this torch cannot use
        problem = cuda_problem(gpus)
        if problem:
            raise UserError(problem)
    vocab = get_preset(args.preset)["vocab"]
    if has_tokenizer(args.base_dir):  # it would be reused: it must be the preset's
        os.environ["NANOCHAT_BASE_DIR"] = args.base_dir
        from nanochat.tokenizer import get_tokenizer

        have_vocab = get_tokenizer().get_vocab_size()
        if have_vocab != vocab:
            raise UserError(
                f"the tokenizer in {get_tokenizer_dir(args.base_dir)} has {have_vocab:,} tokens but "
                f"--preset {args.preset} trains with {vocab:,}; use a fresh --base-dir, or move that "
                "tokenizer folder aside (runs trained with it need it back) so speedrun trains the right one"
            )
    return gpus, vocab, have


def gpu_words(record):
    g = record["gpu"]
    return g["label"] or "H100"  # a CPU plan's hours are quoted on the H100


def print_runs(args, records, done, nproc):
    """The table of runs: size, steps, FLOPs, checkpoints, memory per GPU and time; (disk GiB their checkpoints
    still need, training seconds). done: the stages done (None: runs of another budget, not this command's)."""
    say = lambda *a: print(*a, file=sys.stderr)
    w = max(24, *(len(p["run"]) + 2 for p in records.values()))  # a derived tag makes long names
    say(
        f"{'run':<{w}}{'params':>14}{'FLOPs/token':>16}{'steps':>9}{'tokens':>17}{'total FLOPs':>13}  "
        f"{'checkpoints':<22}{'memory per GPU':<32}est. time"
    )
    need_gib, total_s = 0.0, 0.0
    for run, p in records.items():
        saves = math.ceil(p["num_iterations"] / p["save_every"]) if p["save_every"] else 1
        secs = planned_seconds(p["total_flops"], nproc, p["gpu"]["peak_flops"])
        total_s += secs
        if done is not None and not done[f"train {run}"]:
            need_gib += saves * p["checkpoint_gib"]
        when = "CPU: minutes" if args.preset == "tiny" else f"{hms(secs)} at {PLANNED_MFU:.0%} MFU"
        saved = f"{saves} × {p['checkpoint_gib']:.3g} GiB"
        m = p["memory"]
        mem = (
            f"batch {p['device_batch_size']}: {m['needed_gib']:.1f}/{m['gpu_gib']:.0f} GiB"
            + (" fits" if m["fits"] else " NO FIT")
            if m
            else "not planned (CPU)"
        )
        say(
            f"{p['run']:<{w}}{p['num_params']:>14,}{p['flops_per_token']:>16,}{p['num_iterations']:>9,}"
            f"{p['total_tokens']:>17,}{p['total_flops']:>13.4e}  {saved:<22}{mem:<32}{when}"
        )
    return need_gib, total_s


def print_plan(args, records, done, gpus, have, nproc):
    """The plan on stderr: every run's size, steps, FLOPs and time, the data, checkpoints, disk and stage status.
    Returns the disk space still needed, GiB."""
    say = lambda *a: print(*a, file=sys.stderr)
    nodes = f" per node × {args.nnodes} nodes = {nproc}, this is node {args.node_rank}" if args.nnodes > 1 else ""
    planned_for = not have and not args.gpus and args.preset != "tiny"
    say(
        f"speedrun: preset {args.preset} | arch {','.join(args.archs)} | {gpus} process(es){nodes}"
        + (f" (no GPU visible here: planned for {gpus})" if planned_for else "")
        + f" | base dir {args.base_dir}"
        + (f" | eval bundle {args.eval_bundle}" if args.eval_bundle else "")
        + (f" | base_train extras: {' '.join(args.extra)}" if args.extra else "")
    )
    if args.derived_tag:
        say(
            f"tag: {args.tag} (from the base_train flags after --; the same flags find the same runs again; --tag T "
            "names them yourself)"
        )
    if args.seeds:
        say(
            f"seeds: {','.join(map(str, args.seeds))} (each sets {' and '.join(SEED_FLAGS)} of its runs: every arch "
            "of a seed shares its init seed and data order)"
        )
    need_gib, total_s = print_runs(args, records, done, nproc)
    for budget, other in getattr(args, "other_budgets", {}).items():
        word = budget_word(budget)
        say(f"--flops {word} (the preset's next pair; speedrun --preset {args.preset} --flops {word} trains it):")
        print_runs(args, other, None, nproc)
    tokens = max(p["total_tokens"] for p in records.values())
    if args.offline:
        say("data: offline corpus (python -m nanochat.dataset --offline), no download")
    else:
        gib = (args.shards_needed + 1) * SHARD_MB / 1024
        say(
            f"data: {args.shards_needed} ClimbMix train shards + 1 val shard ≈ {gib:.1f} GiB (assuming "
            f"~{TOKENS_PER_SHARD / 1e6:.0f}M tokens, ~{SHARD_MB} MB per shard; {tokens:,} tokens trained)"
            + ("; every seed reads these shards, in its own order" if args.seeds else "")
        )
        epochs = expected_epochs(tokens, args.shards_needed)
        say(
            f"data: expected epochs {epochs:.2f} (packing keeps ~{PACKING_KEPT:.0%} of the text it reads)"
            + (
                ""
                if epochs <= 1
                else f"; MORE THAN ONE: the last {1 - 1 / epochs:.0%} of the longest run repeats data, raise --shards"
            )
        )
        if not done["data"]:
            need_gib += (args.shards_needed + 1) * SHARD_MB / 1024
    for p in records.values():  # base_train's full plan, optimizer included: diff two configurations with these lines
        say(f"PLAN {json.dumps(p)}")
    periods = " / ".join({p["arch"]: f"{p['save_every'] or p['num_iterations']:,}" for p in records.values()}.values())
    say(
        f"checkpoints: a save every {periods} steps and at the end (base_train --save-every; the optimizer state "
        "sharded over the ranks' files)"
    )
    gpu = gpu_words(next(iter(records.values())))
    if args.seeds:
        cost = (
            "on the CPU, minutes each" if args.preset == "tiny" else f"≈ {hms(total_s)} of training on {nproc} × {gpu}"
        )
        each = f"{len(args.seeds)} × {','.join(args.archs)}"
        say(f"seeds {','.join(map(str, args.seeds))}: {len(records)} runs ({each}), {cost}")
    if args.preset != "tiny":
        peak = next(iter(records.values()))["gpu"]["peak_flops"]
        h100_s = sum(planned_seconds(p["total_flops"], 1) for p in records.values())
        say(
            f"training time: ≈ {hms(total_s)} on {nproc} × {gpu} at {PLANNED_MFU:.0%} MFU"
            + (f" of {peak / 1e12:.0f} TFLOP/s" if peak else " of an H100's peak (nanochat/gpus.py lacks this GPU)")
            + " (+ evaluation)"
            + (f", all {len(records)} runs" if args.seeds else "")
            + ("" if gpu == "H100" else f"; on 1 × H100: ≈ {hms(h100_s)}")
        )
    probe = args.base_dir
    while not os.path.isdir(probe):
        probe = os.path.dirname(probe)
    free_gib = shutil.disk_usage(probe).free / 2**30
    enough = need_gib <= free_gib
    say(
        f"disk: need ≈ {need_gib:.1f} GiB more in {args.base_dir}, {free_gib:.0f} GiB free"
        + ("" if enough else " (NOT ENOUGH: a real run stops here)")
    )
    say("stages:")
    w = max(len(stage) for stage in done) + 1
    for stage, is_done in done.items():
        say(f"  {stage:<{w}} [{'done, skip' if is_done else 'to do'}]")
    return need_gib, free_gib


def plan_and_check(args):
    """Print the plan to stderr; return speedrun.sh's variables: ({name: scalar}, {name: list for a bash array})."""
    gpus, vocab, have = gpus_and_vocab(args)
    nproc = gpus * args.nnodes
    records = plans(args, vocab, nproc)
    batches = {p["device_batch_size"] for p in records.values()}
    if len(batches) > 1:  # auto fits NAG's larger readout in a smaller micro-batch: a comparison keeps one shape
        args.pair_batch = min(batches)
        print(
            f"device batch: {args.pair_batch} for every run (the memory plan alone gives "
            + ", ".join(f"{r} {p['device_batch_size']}" for r, p in records.items())
            + "; the total batch is the same)",
            file=sys.stderr,
        )
        records = plans(args, vocab, nproc)
    if args.every_budget and args.dry_run:  # the preset's other pairs, planned beside the first
        budgets = get_preset(args.preset)["budgets"][1:]
        args.other_budgets = {b: plans(argparse.Namespace(**{**vars(args), "flops": b}), vocab, nproc) for b in budgets}
    tokens = max(p["total_tokens"] for p in records.values())
    args.shards_needed = 0 if args.offline else (args.shards or max(TOK_SHARDS, shards_for(tokens)))
    done = status(args, records)
    need_gib, free_gib = print_plan(args, records, done, gpus, have, nproc)
    launch = launch_command(gpus, args.nnodes, args.max_restarts, args.rdzv_endpoint)
    print(
        f"training launch: {' '.join([*launch, 'scripts.base_train', '--', '...'])}"
        + (" (node 0 alone: data, tokenizer, evaluation, report)" if args.nnodes > 1 else ""),
        file=sys.stderr,
    )
    if not args.dry_run:
        if need_gib > free_gib:
            raise UserError(
                f"not enough disk in {args.base_dir}: need ≈ {need_gib:.1f} GiB, {free_gib:.0f} GiB free "
                "(see --dry-run)"
            )
        if args.node_rank > 0:
            wait_for_node0(args, records)
    others = args.node_rank > 0  # the other nodes join the training runs, nothing else
    preset = get_preset(args.preset)
    preflight = (
        args.preset != "tiny"
        and any(is_nag_arch(pair_arch(args.preset, a)) for a in args.archs)
        and "--nag-impl" not in " ".join(args.extra)
    )
    scalars = {
        "BASE": args.base_dir,
        "PRESET": args.preset,
        "DRY_RUN": int(args.dry_run),
        "OFFLINE": int(args.offline),
        "SHARDS": args.shards_needed,
        "TOK_SHARDS": min(TOK_SHARDS, args.shards_needed),
        "VOCAB": preset["vocab"],
        "TOK_CHARS": TOKENIZER_CHARS.get(args.preset, 2_000_000_000),
        "PREFLIGHT": int(preflight),
        "DATA_DONE": int(done["data"] or others),
        "TOK_DONE": int(done["tokenizer"] or others),
        "PAIR": int(has_pair(args) and not others),
        "ANALYSIS_DONE": int(done.get("analysis", True)),
        "REPORT_DONE": int(done.get("report", True)),
        "REPORT": report_dir(args),
        "LOG": "speedrun.log" if args.node_rank == 0 else f"speedrun-node{args.node_rank}.log",
    }
    # per run i (training order: for each seed the pair's baseline, its NAG run, any other arch): RUNS[i], RUN_ARCH[i],
    # RUN_SEED_ARGS[i] (its seed's base_train flags, one string, "" without --seeds), TRAIN_DONE[i], EVAL_DONE[i];
    # speedrun.sh writes their base_train and base_eval commands out (train_args, eval_args)
    names = list(records)
    arrays = {
        "LAUNCH": launch,
        "EVAL_LAUNCH": launch_command(gpus, max_restarts=0),
        "ANALYSIS": preset["analysis"],
        "FLOPS": flops_args(args),
        "MEMORY": memory_args(args),
        "EXTRA": args.extra,
        "EVAL_PRESET": preset["eval"],
        "BUNDLE": bundle_args(args),
        "COMPARE_RUNS": compared_runs(args) if has_pair(args) else [],
        "RUNS": names,
        "RUN_ARCH": [pair_arch(args.preset, a) for a, _ in runs(args)],
        "RUN_SEED_ARGS": [" ".join(seed_flags(s)) for _, s in runs(args)],
        "TRAIN_DONE": [int(done[f"train {r}"]) for r in names],
        "EVAL_DONE": [int(done[f"eval {r}"] or others) for r in names],
    }
    return scalars, arrays


def plan_file_text(scalars, arrays):
    """speedrun.sh's plan as data: one plain assignment a line (NAME=value, NAME=(values...), and the launch
    environment as `export NAME=value`), every value shell-quoted, so sourcing it sets variables and runs nothing."""
    lines = [f"{k}={shlex.quote(str(v))}" for k, v in scalars.items()]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in LAUNCH_ENV.items()]
    lines += [f"{k}=({' '.join(shlex.quote(str(a)) for a in v)})" for k, v in arrays.items()]
    return "\n".join(lines) + "\n"


def main(argv=None):
    with exit_on_user_error():
        with contextlib.redirect_stdout(sys.stderr):  # --help (ours, or base_train's after --) and notes: the user's
            args = parse(sys.argv[1:] if argv is None else argv)
            scalars, arrays = plan_and_check(args)
        if args.plan_file:  # speedrun.sh's temporary file; --help exits above and leaves it empty: no stage runs
            with open(args.plan_file, "w") as f:
                f.write(plan_file_text(scalars, arrays))


if __name__ == "__main__":
    main()
