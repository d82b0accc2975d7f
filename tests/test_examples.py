"""Every command shown in README.md or a module docstring runs here, or is marked (GPU) or (network).

Every command shown in README.md or in a module docstring either runs here, on a CPU within a time limit,
or is marked (GPU) or (network) where it is shown. Run in order, they are the newcomer's path: data,
tokenizer, a tiny pair, evaluation, comparison, benchmarks."""

import ast
import contextlib
import gc
import glob
import io
import os
import re
import shlex
import subprocess
import sys
import time
import warnings

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_venv = pytest.mark.skipif(
    not os.path.exists(os.path.join(REPO, ".venv", "bin", "python")),
    reason="the bash recipes source runs/setup_env.sh, which would install .venv",
)
MARKERS = ("(GPU)", "(network)")
# shown, but run elsewhere: the suite itself, and the ~15-minute CPU demo made of the commands below
NOT_RUN_HERE = {
    "bash runs/test.sh": "the test suite itself",
    "bash runs/runcpu.sh": "~7 minutes; docs/LOG.md records its runs",
    "python -m scripts.sample --run nag-tiny --prompt-file prompts.txt": "needs a prompts file of yours; "
    "tests/test_sample.py reads one",
    "python -m scripts.bench.sample --run cpu-gpt --run cpu-nag": "the CPU demo's runs (runs/runcpu.sh); the same code "
    "runs on random weights without --run",
    "bash speedrun.sh --preset tiny --base-dir /tmp/nag-chat-tiny": "tests/test_speedrun.py runs this pipeline "
    "three times",
    "bash speedrun.sh --dry-run": "tests/test_speedrun.py::test_dry_run_published_plan runs it and checks the plan",
    **{
        c: "needs three evaluated seeds per arm; tests/test_compare.py compares groups of hand-made runs"
        for c in (
            "python -m scripts.compare --a cpu-gpt-s1 cpu-gpt-s2 cpu-gpt-s3 --b cpu-nag-s1 cpu-nag-s2 cpu-nag-s3",
            "python -m scripts.compare --a gpt-s1 gpt-s2 gpt-s3 --b nag-s1 nag-s2 nag-s3",
        )
    },
    **{
        c: "minutes of training; tests/test_failures.py runs the same code on a tiny model"
        for c in (
            "bash runs/failures.sh --scale cpu",
            "bash runs/failures.sh --scale cpu --seeds 1,2,3",
            "python -m scripts.experiments.failures --scale cpu",
            "python -m scripts.experiments.failures --scale cpu --seeds 1,2,3",
        )
    },
    **{
        c: "~16 minutes of training; tests/test_depth_sweep.py runs the same code on a tiny model"
        for c in ("bash runs/depth_sweep.sh --scale cpu", "python -m scripts.experiments.depth_sweep --scale cpu")
    },
}
# benchmarks whose own test runs the same code on a smaller shape: their shown commands are not run again here
TESTED_ELSEWHERE = {
    "scripts.bench.sample": "tests/test_sample.py::test_bench_sample_prints_both_modes",
    "scripts.bench.attention": "tests/test_attention.py::test_bench_runs_on_the_cpu_with_sdpa_alone",
    "scripts.bench.optim": "tests/test_optim_sharded.py::test_bench_counts_a_share_of_muon_per_rank",
    "scripts.bench.kernel_report": "tests/test_nag_kernels.py::test_kernels_build_for_hopper (the same report)",
    "scripts.bench.train": "tests/test_gpu_checks.py::test_per_block_compile_matches_eager (the README's command, "
    "--compile off,blocks added)",
}
LIMIT_S = 300  # per shell recipe, generous for a contended 2-core machine
# what must run before what: data, tokenizer, training, evaluation, comparison, the rest
# the benchmarks print figures and nothing else reads them: check they still print what they promise
PRINTS = {
    "scripts.bench.nag": ("% of copy", "kernel launches per NAG sub-layer"),
    "scripts.bench.kernel_report": "_nag_backward_kernel",
}
ORDER = [
    "nanochat.dataset",
    "scripts.tok_train",
    "scripts.tok_eval",
    "scripts.base_train",
    "scripts.base_eval",
    "scripts.compare",
]


def shown_commands():
    """(command, marked, where) for every example command in README.md and the module docstrings."""
    found = []
    readme = open(os.path.join(REPO, "README.md")).read().splitlines()
    for i, line in enumerate(readme):
        cmds = re.findall(r"`((?:python -m|bash) [^`]+)`", line) or (
            [line.strip()] if re.match(r"(python -m|bash) ", line.strip()) else []
        )
        found += [(c, any(m in line for m in MARKERS), f"README.md:{i + 1}") for c in cmds]
    for path in sorted(glob.glob(os.path.join(REPO, "*", "*.py"))):
        if "/tests/" in path or "/.venv/" in path:
            continue
        doc = ast.get_docstring(ast.parse(open(path).read())) or ""
        for line in doc.splitlines():
            line = line.strip()
            if re.match(r"(python -m|torchrun|bash) ", line):
                found.append((line, any(m in line for m in MARKERS), os.path.relpath(path, REPO)))
    return [(cmd.split("  #")[0].split(" # ")[0].strip(), marked, where) for cmd, marked, where in found]


def test_every_shown_command_is_run_here_or_marked():
    unmarked = [(c, w) for c, marked, w in shown_commands() if not marked]
    assert unmarked, "no commands found: the parser is broken"
    for cmd, where in unmarked:
        assert cmd.startswith(("python -m", "bash")) and not cmd.startswith("torchrun"), (where, cmd)
    # an unmarked multi-GPU or network command would be caught here
    assert not [c for c, w in unmarked if "torchrun" in c or "-n 8" in c], unmarked


def order_key(cmd):
    module = cmd.split()[2] if cmd.startswith("python -m") else "~bash"
    rank = ORDER.index(module) if module in ORDER else len(ORDER)
    return rank, "--resume" in cmd, "--dry-run" in cmd


def run_in_process(argv, env):
    """`python -m MODULE ARGS` in this process, as its own process would run it (its `__main__` block included):
    (exit status, output). Every module's process entry is tested by tests/test_help.py; here a command costs its
    work, not another start of Python and torch."""
    import runpy
    import torch

    out = io.StringIO()
    saved = sys.argv, dict(os.environ), os.getcwd(), torch.get_num_threads()
    sys.argv = [argv[2], *argv[3:]]
    os.environ.update(env)
    os.chdir(REPO)
    torch.set_num_threads(1)  # as OMP_NUM_THREADS=1 gives a process
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out), warnings.catch_warnings():
            # imported before: expected here
            warnings.filterwarnings("ignore", "'.*' found in sys.modules", RuntimeWarning)
            runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = saved[0]
        os.environ.clear()
        os.environ.update(saved[1])
        os.chdir(saved[2])
        torch.set_num_threads(saved[3])
        gc.unfreeze()  # base_train freezes the heap after its first step (its own module, not the patched one)
    return code, out.getvalue()


@needs_venv
def test_shown_commands_run_on_a_cpu(tmp_path, write_eval_bundle, capsys):
    shown = {
        c
        for c, marked, _ in shown_commands()
        if not marked
        and c not in NOT_RUN_HERE
        and not any(c.split("#")[0].split()[2:3] == [m] for m in TESTED_ELSEWHERE)
    }
    # `bash runs/X.sh ARGS` runs `python -m scripts.X ARGS` once its environment is set up: one of the twins is enough
    twins = {
        c
        for c in shown
        if c.startswith("python -m scripts.") and re.sub(r"^python -m scripts\.(\w+)", r"bash runs/\1.sh", c) in shown
    }
    commands = sorted(shown - twins, key=order_key)
    base = tmp_path / "base"
    bundle = write_eval_bundle(
        tmp_path / "bundle",
        [
            (
                "tiny_lm",
                "language_modeling",
                0,
                0.0,
                [{"context": f"Line {i} of the", "continuation": " docs"} for i in range(4)],
            )
        ],
    )
    env = {"NANOCHAT_BASE_DIR": str(base), "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}

    def run(cmd):
        argv = shlex.split(cmd.replace("/tmp/nag-chat-", str(tmp_path / "nag-chat-")))  # the examples' own folders
        if argv[:3] == ["python", "-m", "scripts.base_eval"]:
            argv += ["--eval-bundle", bundle]  # the default would download the real bundle
        # speedrun (also under failures.sh's published runs) starts from a fresh node: in the pieces' base dir it
        # would refuse their 4,096-token tokenizer
        published = "speedrun" in cmd.split()[1 if cmd.startswith("bash") else 2] or "--scale published" in cmd
        fresh = {"NANOCHAT_BASE_DIR": str(tmp_path / "fresh-node")} if published else {}
        t0 = time.time()
        if argv[0] == "python":
            code, output = run_in_process(argv, {**env, **fresh})
        else:  # the shell recipes: a process of their own, as a user starts them
            proc_env = {k: v for k, v in os.environ.items() if k != "NANOCHAT_OFFLINE"}
            out = subprocess.run(
                argv, cwd=REPO, env={**proc_env, **env, **fresh}, capture_output=True, text=True, timeout=LIMIT_S
            )
            code, output = out.returncode, out.stdout + out.stderr
        return time.time() - t0, cmd, argv, code, output

    def check(seconds, cmd, argv, code, output):
        assert code == 0, f"{cmd}\n{output[-4000:]}"
        expected = PRINTS.get(argv[2] if len(argv) > 2 else "")
        assert expected is None or any(e in output for e in ((expected,) if isinstance(expected, str) else expected)), (
            cmd,
            output[-2000:],
        )
        times.append((seconds, cmd))

    times, started = [], time.time()
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("NANOCHAT_OFFLINE", raising=False)
        for cmd in commands:  # in order: each of the first needs what the ones before made; the rest only read
            check(*run(cmd))
    with capsys.disabled():
        print(
            f"\n{len(commands)} shown commands ran in {time.time() - started:.0f} s; slowest: "
            + "; ".join(f"{t:.0f} s {c[:60]}" for t, c in sorted(times, reverse=True)[:3])
        )
