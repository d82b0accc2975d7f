"""Small shared utilities used across the repo.

Base directory, device and dtype choice, distributed info, logging, atomic writes,
the peak-FLOPs table, the git commit and package versions, the one rule for a list of seeds and the one rule for
the numbers of a command line, a progress line."""

import os
import sys
import json
import math
import argparse
import unicodedata
import tempfile
import time
import contextlib
import re
import subprocess
from datetime import timedelta

import torch
import torch.distributed as dist


def caller_path(path):
    """A path the user typed, made absolute from the directory the command was started in (speedrun.sh and
    the runs/ scripts cd to the repo root; they pass their starting directory as $NANOCHAT_CALLER_CWD)."""
    return os.path.abspath(os.path.join(os.environ.get("NANOCHAT_CALLER_CWD") or os.getcwd(), os.path.expanduser(path)))


def base_dir_path(flag=None):
    """The base dir, not created: --base-dir (flag), else $NANOCHAT_BASE_DIR, else ~/.cache/nanochat; absolute,
    a relative path taken from the caller's directory."""
    return caller_path(flag or os.environ.get("NANOCHAT_BASE_DIR") or "~/.cache/nanochat")


def get_base_dir():
    # everything the project writes (data, tokenizer, runs) lives under one directory
    base = os.environ.get("NANOCHAT_BASE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "nanochat")
    try:
        os.makedirs(base, exist_ok=True)
    except OSError as e:
        raise UserError(
            f"cannot create the base dir {base} ({e.strerror}); set NANOCHAT_BASE_DIR to a writable directory"
        ) from None
    return base


def get_dist_info():
    """(is_ddp, rank, local_rank, world_size): torchrun's variables, else those of a plain `srun` of several tasks
    (SLURM_STEP_NUM_TASKS is set by srun only, so a script run by the batch shell itself stays one process)."""
    if all(k in os.environ for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE")):
        return True, int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    if int(os.environ.get("SLURM_STEP_NUM_TASKS", "1")) > 1 and "SLURM_PROCID" in os.environ:
        return (
            True,
            int(os.environ["SLURM_PROCID"]),
            int(os.environ.get("SLURM_LOCALID", "0")),
            int(os.environ["SLURM_STEP_NUM_TASKS"]),
        )
    return False, 0, 0, 1


def print0(*args, **kwargs):
    """A log line of rank 0. When its reader is gone (`| head` exited) the work goes on and the lines are dropped:
    an evaluation or a training run is never cut short, or left half-recorded, by the end of a pipe."""
    if get_dist_info()[1] == 0:
        stream = kwargs.get("file") or sys.stdout
        try:
            print(*args, **kwargs, flush=True)
        except BrokenPipeError:
            # the file descriptor now writes to /dev/null: later lines, and the flush at exit, raise nothing
            os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())


def autodetect_device_type():
    if torch.cuda.is_available():
        return "cuda"
    if torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def compute_dtype_for(device_type):
    # bf16 matmuls where the hardware does them natively (SM80+), fp32 everywhere else
    if device_type == "cuda" and torch.cuda.get_device_capability()[0] >= 8:
        return torch.bfloat16
    return torch.float32


def script_argv(argv=None):
    """A script's arguments without a leading "--": `torchrun ... -m scripts.X -- ARGS` (the -- keeps torchrun
    from reading ARGS as its own) passes it through."""
    argv = list(sys.argv[1:] if argv is None else argv)
    return argv[1:] if argv[:1] == ["--"] else argv


class UserError(Exception):
    """A problem with the user's input: reported as one line, without a traceback."""


@contextlib.contextmanager
def exit_on_user_error(*also, interrupted="interrupted"):
    """Wrap a script's body: a UserError (or one of `also`) becomes one `error: ...` line on stderr, exit status 1;
    Ctrl-C becomes the one line `interrupted` (say what a rerun does), exit status 130, no traceback."""
    try:
        yield
    except (UserError, *also) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print(interrupted, file=sys.stderr)
        sys.exit(130)


def ensure_writable_dir(path):
    """Create path if needed and prove it takes a file, before any work whose results would go there."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise UserError(
            f"cannot write to {path} ({e.strerror or e}); choose a writable location (NANOCHAT_BASE_DIR)"
        ) from None


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


FILE_MODE = 0o666 & ~_umask()  # what open() would give; mkstemp's own 0600 would hide results from collaborators


def atomic_write(path, write):
    """Call write(file) on a temp file in the same directory, fsync, then rename over path:
    a crash never leaves a half-written file, only the old one or the new one."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-" + os.path.basename(path))
    os.chmod(tmp, FILE_MODE)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def atomic_write_bytes(path, data):
    atomic_write(path, lambda f: f.write(data))


def atomic_write_json(path, obj):
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def atomic_torch_save(obj, path):
    try:
        atomic_write(path, lambda f: torch.save(obj, f))
    except RuntimeError as e:
        # a failed write inside torch.save (a full disk) surfaces as the zip writer's "unexpected pos": the OSError it
        # was raised over is the error to report
        if isinstance(e.__context__, OSError):
            raise e.__context__ from None
        raise


START_TIMEOUT = 1200  # seconds a collective may wait at start-up (compile, data, checkpoint loading) and while saving


def dist_init(device_type, timeout=START_TIMEOUT):
    """Initialise torch.distributed under torchrun or srun (nccl on cuda, gloo elsewhere), with a collective timeout
    of `timeout` seconds instead of the backends' 10 (NCCL) or 30 (gloo) minutes. Returns (is_ddp, rank,
    local_rank, world_size, device)."""
    is_ddp, rank, local_rank, world_size = get_dist_info()
    if device_type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device(device_type)
    if is_ddp and not dist.is_initialized():
        if "RANK" not in os.environ:  # srun: the env:// rendezvous reads torchrun's names
            if not (os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT")):
                raise UserError(
                    f"srun started {world_size} tasks but MASTER_ADDR / MASTER_PORT are not set: export them "
                    "before srun (runs/slurm_pair.sbatch shows how), or launch with torchrun"
                )
            os.environ.update(RANK=str(rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world_size))
        dist.init_process_group(
            backend="nccl" if device_type == "cuda" else "gloo",
            timeout=timedelta(seconds=timeout),
            device_id=device if device_type == "cuda" else None,
        )
    return is_ddp, rank, local_rank, world_size, device


def git_commit():
    """The repo's HEAD commit, with -dirty when tracked files differ from it; "unknown" outside a git checkout."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=here,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return (sha + ("-dirty" if dirty else "")) or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


# the packages whose version can move a run's numbers in the last digits (docs/runs.md: what reproducible means)
RECORDED_PACKAGES = ("torch", "triton", "numpy", "pyarrow", "tiktoken", "rustbpe")


def package_versions():
    """{package: installed version, or None where it is not installed}: config.json's `versions`."""
    from importlib import metadata

    versions = {}
    for name in RECORDED_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def check_run_name(run):
    """The one rule for a new run's name (--run; a path's last component): it starts with a letter or digit, and the
    whole holds no control character. A name like -x reads as a flag, .x hides, a newline breaks every line naming
    it."""
    if any(unicodedata.category(c) == "Cc" for c in run):
        raise UserError(f"{run!r} is not a run name: it holds a control character; give a name like gpt-d20")
    name = os.path.basename(os.path.normpath(run)) if run.strip() else ""
    if not name[:1].isalnum():
        raise UserError(
            f"{run!r} is not a run name: a run's name starts with a letter or digit; give a name like gpt-d20, "
            "or leave --run out for <arch>-d<depth>"
        )


def parse_seeds(text, flag="--seeds"):
    """A list of seeds like 1,2,3: different non-negative integers, comma-separated, nothing else (no spaces: the
    shell recipes split on commas alone). The one seed-list rule: runcpu.sh, speedrun.sh and the experiments use it."""
    pieces = text.split(",")
    seeds = [int(p) for p in pieces if p.isdigit() and p.isascii()]
    if len(seeds) != len(pieces) or len(set(seeds)) != len(seeds):  # a repeated seed would count one run twice
        raise UserError(f"{flag} takes different non-negative integers separated by commas, like 1,2,3; got {text!r}")
    return seeds


# ---------------------------------------------------------------------------
# The one rule for the numbers of a command line: every LR, decay, count, size and step flag of base_train, base_eval,
# compare, analysis, sample, export_hf, tok_train, tok_eval, speedrun, check_cuda and the depth sweep is parsed by one
# of these argparse types. Positive where 0 or a negative means nothing; -1 the one "unset" value, where a flag has one
# (the help says what it means); 0 only where the help says what it does. A refusal is one `error: --flag must be ...`
# line (parse_checked), before any work.


class NumberRule(argparse.ArgumentTypeError):
    """A value a number rule refuses; its text follows the flag's name ("must be positive; got -1")."""


class Number:
    """An argparse type: a finite number of `kind` (int or float) that `ok` accepts, else NumberRule(rule)."""

    def __init__(self, kind, ok, rule):
        self.kind, self.ok, self.rule = kind, ok, rule
        self.__name__ = kind.__name__  # what argparse calls the type in its own messages

    def __call__(self, text):
        try:
            v = self.kind(text)
        except ValueError:
            raise NumberRule(f"takes {'a whole number' if self.kind is int else 'a number'}; got {text!r}") from None
        if not (math.isfinite(v) and self.ok(v)):
            raise NumberRule(f"{self.rule}; got {text}")
        return v

    def __repr__(self):
        return f"Number({self.kind.__name__}: {self.rule})"


def positive(kind=float):
    """> 0: an LR, a size, a count of tokens or steps."""
    return Number(kind, lambda v: v > 0, "must be positive")


def positive_or_unset(kind, unset):
    """> 0, or -1 meaning `unset` (what the help says): no other non-positive value means anything."""
    return Number(kind, lambda v: v > 0 or v == -1, f"must be a positive number, or -1 ({unset})")


def non_negative(kind, zero):
    """>= 0, where 0 means `zero` (what the help says): a decay, a warm-up, an interval that 0 turns off."""
    return Number(kind, lambda v: v >= 0, f"must be >= 0 (0: {zero})")


def non_negative_or_unset(kind, unset, zero=None):
    """>= 0 (0 meaning `zero`, when given), or -1 meaning `unset`."""
    return Number(
        kind, lambda v: v >= 0 or v == -1, "must be >= 0" + (f" (0: {zero})" if zero else "") + f", or -1 ({unset})"
    )


def fraction(top_open=False, unset=None):
    """In [0, 1] ([0, 1) with top_open), or -1 meaning `unset` when given."""
    inside = (lambda v: 0 <= v < 1) if top_open else (lambda v: 0 <= v <= 1)
    span = f"[0, 1{')' if top_open else ']'}"
    return Number(
        float,
        (lambda v: inside(v) or v == -1) if unset else inside,
        f"must be in {span}" + (f", or -1 ({unset})" if unset else ""),
    )


def auto_or(number):
    """The word "auto" (a value the program works out), or a number of the given rule."""

    def parse(text):
        return "auto" if text == "auto" else number(text)

    parse.__name__ = f"auto or {number.__name__}"
    return parse


positive_int, positive_float = positive(int), positive(float)
STEP = non_negative_or_unset(int, "the latest checkpoint")  # --step of every tool that reads a checkpoint


def parse_checked(parser, argv=None, known=False):
    """parser.parse_args(argv) (known: parse_known_args, (args, the rest)), with a value a number rule refuses ending in
    one `error: --flag must be ...` line and exit status 1, as every other user error; any other argparse error stays
    argparse's (usage, status 2)."""
    parser.exit_on_error = False
    try:
        return parser.parse_known_args(argv) if known else parser.parse_args(argv)
    except argparse.ArgumentError as e:
        if isinstance(e.__context__, NumberRule):
            with exit_on_user_error():
                raise UserError(f"{e.argument_name} {e.__context__}") from None
        parser.error(str(e))


class Progress:
    """A line now and then on long work ("val bpb: 40/128 batches | 0m45s, eta 1m30s"), at most one per `every`
    seconds and none for work that ends sooner: a stage that runs for minutes on a busy CPU shows it is moving.
    Host time: on a GPU the host runs ahead of the device, so the first lines' ETA errs low."""

    def __init__(self, what, total, unit, every=30.0, log=None):
        self.what, self.total, self.unit, self.every = what, total, unit, every
        self.log = log or print0
        self.start = self.last = time.time()

    def update(self, done):
        now = time.time()
        if now - self.last < self.every or not 0 < done < self.total:
            return
        self.last = now
        elapsed = now - self.start
        self.log(
            f"{self.what}: {done}/{self.total} {self.unit} | {fmt_time(elapsed)}, eta "
            f"{fmt_time(elapsed * (self.total - done) / done)}"
        )


def fmt_time(s):
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def nvidia_smi():
    """(GPUs listed, driver version, the CUDA version the driver supports); (0, None, None) without nvidia-smi."""
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
        header = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return 0, None, None
    count = sum(line.startswith("GPU") for line in listed.splitlines())
    driver = re.search(r"Driver Version:\s*([\d.]+)", header)
    cuda = re.search(r"CUDA Version:\s*([\d.]+)", header)
    return count, driver and driver.group(1), cuda and cuda.group(1)


def cuda_problem(need=None):
    """None when torch sees at least `need` CUDA devices (default: every GPU nvidia-smi lists, at least one);
    else one line saying what torch and the driver report and what to do."""
    listed, driver, driver_cuda = nvidia_smi()
    need = need or max(listed, 1)
    seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if seen >= need:
        return None
    build = (
        f"torch {torch.__version__} ("
        + (f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU build, no CUDA")
        + ")"
    )
    smi = (
        f"nvidia-smi lists {listed} GPU(s), driver {driver or '?'} (CUDA {driver_cuda or '?'})"
        if listed
        else "nvidia-smi lists no GPU"
    )
    if not torch.version.cuda:
        fix = "remove .venv and run `source runs/setup_env.sh` on this node to install the CUDA build"
    elif listed:
        fix = (
            f"the driver must support CUDA {torch.version.cuda}: upgrade the driver, "
            "or set NANOCHAT_TORCH_INDEX (README) and rebuild .venv"
        )
    else:
        fix = "check that the GPUs are visible here (CUDA_VISIBLE_DEVICES, the container's --gpus)"
    return f"torch sees {seen} CUDA device(s), {need} needed: {build}; {smi}; {fix}"


def seed_flags(seed):
    """base_train's flags for one seed of an experiment's --seeds (None: none, the defaults). The one rule: a seed
    sets both the init (--seed) and the data order (--data-seed), so every arch of one seed reads the same data."""
    return [] if seed is None else ["--seed", str(seed), "--data-seed", str(seed)]
