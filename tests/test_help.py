"""The shell entry points: --help, bad flags, and paths relative to the caller's directory.

--help prints the usage and starts nothing; bad flags end in one line; paths given
relative to the directory a command runs in stay relative to it, though every script changes to the repo root."""

import glob
import os
import re
import signal
import subprocess
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HELP_LIMIT_S = 20
# runs/gpu_checks.sh is a GPU-only list of measurements, runs/setup_env.sh is sourced, not run
NOT_COMMANDS = {"runs/gpu_checks.sh", "runs/setup_env.sh"}
COMMANDS = ["speedrun.sh"] + sorted(
    os.path.relpath(p, REPO)
    for p in glob.glob(os.path.join(REPO, "runs", "*.sh"))
    if os.path.relpath(p, REPO) not in NOT_COMMANDS
)
needs_venv = pytest.mark.skipif(
    not os.path.exists(os.path.join(REPO, ".venv", "bin", "python")),
    reason="these scripts source runs/setup_env.sh, which would install .venv",
)


def run(script, *args, cwd, base, limit=HELP_LIMIT_S, **env):
    """bash script args in cwd with NANOCHAT_BASE_DIR=base; killed with everything it started after `limit` seconds.
    Returns (exit status, stdout + stderr, seconds)."""
    full = dict(os.environ, NANOCHAT_BASE_DIR=str(base), OMP_NUM_THREADS="1", **env)
    for k in ("NANOCHAT_OFFLINE", "NANOCHAT_CALLER_CWD"):
        full.pop(k, None)
    t0 = time.time()
    proc = subprocess.Popen(
        ["bash", os.path.join(REPO, script), *args],
        cwd=cwd,
        env=full,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the whole group: a pipeline it started must not outlive the test
        out, err = proc.communicate()
        pytest.fail(
            f"bash {script} {' '.join(args)} still running after {limit} s: it started "
            f"something\n{out[-2000:]}{err[-2000:]}"
        )
    return proc.returncode, out + err, time.time() - t0


def test_every_command_is_covered():
    assert "runs/runcpu.sh" in COMMANDS and "runs/failures.sh" in COMMANDS and len(COMMANDS) >= 9


@needs_venv
@pytest.mark.parametrize("script", COMMANDS)
def test_help_prints_usage_and_starts_nothing(tmp_path, script):
    base, cwd = tmp_path / "base", tmp_path / "cwd"
    base.mkdir()
    cwd.mkdir()
    for flag in ("--help", "-h") if script in ("speedrun.sh", "runs/runcpu.sh") else ("--help",):
        code, out, secs = run(script, flag, cwd=cwd, base=base)
        assert code == 0, out[-3000:]
        assert secs < HELP_LIMIT_S
        stem = os.path.basename(script)[: -len(".sh")]
        assert stem in out and "===" not in out and "Traceback" not in out, out[-3000:]
    assert os.listdir(base) == [] and os.listdir(cwd) == []  # no data, tokenizer, run or log


def test_scripts_without_flags_refuse_them(tmp_path):
    # `bash runs/runcpu.sh --dry-run` used to start the whole pipeline
    for script in ("runs/runcpu.sh", "runs/mod_cpu.sh", "runs/mod_published.sh"):
        code, out, _ = run(
            script, "--dry-run" if script != "runs/mod_published.sh" else "--gpus", cwd=tmp_path, base=tmp_path / "base"
        )
        assert code == 1 and out.strip().startswith("error: ") and len(out.strip().splitlines()) == 1, out
    assert os.listdir(tmp_path) == []


@needs_venv
@pytest.mark.parametrize("seeds", ["1,x", "1,1", "1, 2", "2,1,2"])
def test_runcpu_bad_seeds_is_one_line_and_writes_nothing(tmp_path, seeds):
    """The one seed-list rule of speedrun.sh and the experiments: SEEDS=1,1 once trained each run once and reported
    groups of two with "± 0.0000"; "1, 2" was refused here and accepted by speedrun.sh."""
    code, out, _ = run("runs/runcpu.sh", cwd=tmp_path, base=tmp_path / "base", SEEDS=seeds)
    assert (
        code == 1
        and out.strip()
        == f"error: SEEDS takes different non-negative integers separated by commas, like 1,2,3; got {seeds!r}"
    ), out
    assert os.listdir(tmp_path) == []


@needs_venv
def test_failures_bad_seeds_is_one_line_and_writes_nothing(tmp_path):
    code, out, _ = run("runs/failures.sh", "--seeds", "a", cwd=tmp_path, base=tmp_path / "base")
    assert (
        code == 1
        and out.strip()
        == "error: --seeds takes different non-negative integers separated by commas, like 1,2,3; got 'a'"
    ), out[-3000:]
    assert not (tmp_path / "base").exists()  # checked before the corpus and tokenizer are built


@needs_venv
def test_failures_cpu_dry_run_with_relative_base_dir(tmp_path):
    code, out, _ = run(
        "runs/failures.sh",
        "--scale",
        "cpu",
        "--dry-run",
        "--seeds",
        "1,2",
        "--base-dir",
        "rel",
        cwd=tmp_path,
        base=tmp_path / "unused",
        limit=60,
    )
    assert code == 0, out[-3000:]
    assert (
        f"8 runs in {tmp_path}/rel/runs" in out
        and out.count("| to do |") == 8
        and "dry run: nothing was trained" in out
    )
    assert os.listdir(tmp_path) == []  # no corpus, tokenizer or run


@needs_venv
def test_speedrun_paths_are_the_callers(tmp_path):
    (tmp_path / "bundle").mkdir()
    # through runs/published_pair.sh, which hands over to speedrun.sh: two scripts that change directory
    code, out, _ = run(
        "runs/published_pair.sh",
        "--dry-run",
        "--base-dir",
        "rel",
        "--eval-bundle",
        "bundle",
        "--arch",
        "nag",
        cwd=tmp_path,
        base=tmp_path / "unused",
        limit=60,
    )
    assert code == 0, out[-3000:]
    assert f"| base dir {tmp_path}/rel | eval bundle {tmp_path}/bundle\n" in out, out[-3000:]
    # $NANOCHAT_BASE_DIR relative, to speedrun.sh itself
    code, out, _ = run("speedrun.sh", "--dry-run", "--arch", "gpt", cwd=tmp_path, base="relenv", limit=60)
    assert code == 0 and f"| base dir {tmp_path}/relenv\n" in out, out[-3000:]
    assert sorted(os.listdir(tmp_path)) == ["bundle"]  # a dry run writes nothing


@needs_venv
def test_speedrun_derives_a_tag_from_extra_flags(tmp_path):
    # README's `bash speedrun.sh -- --nag-mod-floor 0` used to plan (and skip as done) the default runs;
    # tests/test_speedrun.py checks that the name is stable and that a finished default run is not taken for it
    code, out, _ = run(
        "speedrun.sh",
        "--dry-run",
        "--preset",
        "tiny",
        "--",
        "--nag-mod-floor",
        "0",
        "--save-every",
        "5",
        cwd=tmp_path,
        base=tmp_path / "base",
        limit=60,
    )
    assert code == 0, out[-3000:]
    assert "tag: nag-mod-floor0 " in out, out[-3000:]
    assert re.search(r"^gpt-tiny-nag-mod-floor0 ", out, re.M) and re.search(r"^nag-tiny-nag-mod-floor0 ", out, re.M), (
        out[-3000:]
    )
    assert not (tmp_path / "base").exists()


def test_setup_env_help_prints_usage_and_sets_nothing_up(tmp_path):
    """`bash runs/setup_env.sh --help` ran the set-up (printing nothing when .venv existed); sourced by the recipes it
    still reads no flags of theirs (speedrun.sh --help is covered above)."""
    code, out, _ = run(
        "runs/setup_env.sh", "--help", cwd=tmp_path, base=tmp_path / "base", NANOCHAT_VENV=str(tmp_path / "venv")
    )
    assert code == 0 and "Source it" in out and "[setup]" not in out, out
    code, out, _ = run(
        "runs/setup_env.sh", "--dry-run", cwd=tmp_path, base=tmp_path / "base", NANOCHAT_VENV=str(tmp_path / "venv")
    )
    assert code == 1 and out.strip() == "error: setup_env.sh takes no arguments (see --help)", out
    assert os.listdir(tmp_path) == []
