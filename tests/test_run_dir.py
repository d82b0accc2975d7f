"""Run directories that never lose or mix data.

--resume latest, history kept across restarts, the run lock,
checked names and values, corrupt files, and a kill -9 fault-injection run that must end bit-exact."""

import json
import os
import random
import signal
import subprocess
import sys
import time
import types

import pytest
import torch

from conftest import TINY_TRAIN
from nag.archs import plan_for
from nanochat.plan import lr_multiplier
from scripts import base_train
from nanochat import checkpoint_manager as ckpt
from nanochat.run_dir import resolve_run_dir, run_path
from nanochat.common import UserError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(*argv):
    return base_train.main(TINY_TRAIN + list(argv))


def cli(argv):  # what script_error calls
    return main(*argv)


def steps_of(path):
    return [json.loads(line)["step"] for line in open(path)]


def run_files(run_dir):
    return {f: os.stat(os.path.join(run_dir, f)).st_mtime_ns for f in os.listdir(run_dir) if f != ".lock"}


COMMON = ["--run", "r", "--num-iterations", "8", "--save-every", "4", "--eval-every", "-1"]


def test_resume_latest_skips_a_checkpoint_without_meta(run_base, capsys):
    run_dir = main(*COMMON)
    os.remove(os.path.join(run_dir, "meta_000008.json"))  # a crash between the model file and the meta
    main(*COMMON, "--resume", "latest")
    out = capsys.readouterr().out
    assert "skipping the incomplete checkpoint of step 8" in out and "resumed from step 4" in out
    assert steps_of(os.path.join(run_dir, "metrics.jsonl")) == list(range(9))
    assert ckpt.complete_steps(run_dir) == [4, 8]


@pytest.mark.parametrize("damaged", ["model_000008.pt", "optim_000008_rank0.pt"])
def test_resume_latest_of_a_finished_run_with_a_truncated_newest_checkpoint_trains_it_again(run_base, capsys, damaged):
    """It said "already finished its 8 steps; nothing to do" (exit 0) while sample and export refused the file. The
    sizes the save recorded name the damage; the run continues from step 4 and ends as the undamaged run did."""
    run_dir = main(*COMMON)
    want = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    path = os.path.join(run_dir, damaged)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)  # a copy cut short, a disk that lost its tail
    assert ckpt.complete_steps(run_dir) == [4]
    main(*COMMON, "--resume", "latest")
    out = capsys.readouterr().out
    assert (
        f"skipping the incomplete checkpoint of step 8 in {run_dir} ({damaged} holds " in out
        and "the file is damaged" in out
    )
    assert "resumed from step 4" in out and "nothing to do" not in out
    got = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert [(r["step"], r["train_loss"]) for r in got] == [(r["step"], r["train_loss"]) for r in want]
    assert ckpt.complete_steps(run_dir) == [4, 8]


def test_resume_latest_on_a_finished_run_is_a_no_op(run_base, capsys):
    run_dir = main(*COMMON)
    before = run_files(run_dir)
    main(*COMMON, "--resume", "latest")
    assert "already finished its 8 steps; nothing to do" in capsys.readouterr().out
    assert run_files(run_dir) == before


def test_resume_latest_starts_a_new_run(run_base):
    run_dir = main(*COMMON, "--resume", "latest")
    assert steps_of(os.path.join(run_dir, "metrics.jsonl")) == list(range(9))


def test_a_failed_resume_keeps_history_and_a_real_one_keeps_the_removed_rows(run_base, script_error, monkeypatch):
    run_dir = main(*COMMON)
    metrics = os.path.join(run_dir, "metrics.jsonl")
    before = open(metrics).read()

    # refused by a late check (the data loader's): nothing in the run directory changes
    def broken_loader(*a, **k):
        raise base_train.UserError("the data changed")

    with monkeypatch.context() as mp:
        mp.setattr(base_train, "data_loader", broken_loader)
        assert "the data changed" in script_error(cli, *COMMON, "--resume", "4")
    assert open(metrics).read() == before
    # a shorter horizon is a different LR schedule: refused unless asked for
    err = script_error(cli, *COMMON[:3], "6", *COMMON[4:], "--resume", "4")
    assert "planned for 8 steps" in err and "--change-settings" in err
    assert open(metrics).read() == before
    # a real resume from step 4: rows 5..8 move to metrics.jsonl.bak-4, then 5..8 are written again
    main(*COMMON, "--resume", "4")
    assert steps_of(metrics) == list(range(9))
    assert steps_of(metrics + ".bak-4") == [5, 6, 7, 8]
    # an explicit horizon change
    main(*COMMON[:3], "12", *COMMON[4:], "--resume", "latest", "--change-settings")
    assert steps_of(metrics) == list(range(13))
    assert json.load(open(os.path.join(run_dir, "config.json")))["num_iterations"] == 12


def test_nag_and_recipe_flags_on_gpt_are_named(run_base, capsys):
    main(
        "--arch",
        "gpt",
        "--run",
        "g",
        "--num-iterations",
        "1",
        "--eval-every",
        "-1",
        "--nag-mod-floor",
        "0",
        "--no-smear",
    )
    out = capsys.readouterr().out
    assert (
        "note: --nag-alpha-warmup-tokens, --nag-mod-floor apply only "
        "with a NAG arch (nag, nag-recipe); this gpt run ignores them" in out
    )
    assert "note: --no-smear applies only with a recipe arch (gpt-recipe, nag-recipe); this gpt run ignores it" in out


def test_settings_cannot_drift_on_resume(run_base, script_error):
    nag = ["--arch", "nag", *COMMON]
    run_dir = main(*nag)
    cfg_path = os.path.join(run_dir, "config.json")
    for f in ("model_000008.pt", "meta_000008.json", "optim_000008_rank0.pt"):
        os.remove(os.path.join(run_dir, f))  # as if it had stopped after the checkpoint of step 4
    before = open(cfg_path).read()
    err = script_error(cli, *nag, "--resume", "latest", "--nag-mod-floor", "0", "--nag-gate-lr", "0.5")
    assert "cannot resume" in err and "--nag-gate-lr 0.001 → 0.5" in err and "--nag-mod-floor 1e-06 → 0.0" in err
    assert "--change-settings" in err and open(cfg_path).read() == before
    main(*nag, "--resume", "latest", "--nag-mod-floor", "0", "--change-settings")
    cfg = json.load(open(cfg_path))
    assert cfg["args"]["nag_mod_floor"] == 0.0
    assert [seg["start_step"] for seg in cfg["segments"]] == [0, 4]
    assert cfg["segments"][1]["changes"] == {"--nag-mod-floor": {"then": 1e-06, "now": 0.0}}
    # the finished run with yet other settings: refused, not "nothing to do"
    err = script_error(cli, *nag, "--resume", "latest", "--nag-mod-floor", "1e-3")
    assert "cannot reuse the finished run" in err and "--nag-mod-floor 0.0 → 0.001" in err and "another --run" in err


def test_resume_on_other_data_is_refused(run_base, tiny_base_dir, script_error, monkeypatch):
    import shutil

    run_dir = main(*COMMON[:3], "4", *COMMON[4:])
    cfg = json.load(open(os.path.join(run_dir, "config.json")))
    assert set(cfg["fingerprints"]) == {"tokenizer", "data_train", "data_val"}
    assert ckpt.load_meta(run_dir, 4)["fingerprints"] == cfg["fingerprints"]
    # the same corpus with one train shard rewritten (one document fewer)
    import pyarrow.parquet as pq

    data = os.path.join(run_base, "base_data")
    os.remove(data)
    shutil.copytree(os.path.join(tiny_base_dir, "base_data"), data)
    shard = os.path.join(data, "shard_00000.parquet")
    table = pq.read_table(shard)
    pq.write_table(table.slice(0, table.num_rows - 1), shard, row_group_size=8)
    err = script_error(cli, *COMMON, "--resume", "latest", "--change-settings")
    assert "its train data changed" in err and cfg["fingerprints"]["data_train"] in err


def test_data_too_small_for_the_ranks_is_refused_before_anything_is_written(run_base, script_error):
    # 64 micro-batches per step: more shards of the train split than it has row groups
    err = script_error(cli, "--run", "v", "--num-iterations", "2", "--total-batch-size", str(256 * 64))
    assert "row groups, fewer than the 64 ranks" in err
    assert not os.path.exists(os.path.join(run_base, "runs", "v", "config.json"))
    assert not os.path.exists(os.path.join(run_base, "runs", "v", "metrics.jsonl"))


def test_a_full_disk_while_saving_is_one_line_and_leaves_no_partial_checkpoint(run_base, script_error, monkeypatch):
    """ENOSPC injected into the file torch.save writes (past its first bytes, as a disk fills): torch.save itself
    turns it into its zip writer's RuntimeError ("unexpected pos"), which once ended in a 30-line traceback."""
    import errno
    import io
    from nanochat import common

    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc to tell which file a descriptor writes")
    real_fdopen = common.os.fdopen

    class FillsUp(io.RawIOBase):
        def __init__(self, f):
            self.f, self.n = f, 0

        def writable(self):
            return True

        def write(self, b):
            self.n += len(b)
            if self.n > 4096:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(b)

        def fileno(self):
            return self.f.fileno()

        def close(self):
            self.f.close()
            super().close()

    def fdopen(fd, *a, **k):
        f = real_fdopen(fd, *a, **k)
        return FillsUp(f) if "model_000008" in os.readlink(f"/proc/self/fd/{fd}") else f

    monkeypatch.setattr(common.os, "fdopen", fdopen)
    err = script_error(cli, *COMMON)
    assert "cannot save the checkpoint of step 8" in err and "No space left on device" in err and "step 4" in err
    run_dir = os.path.join(run_base, "runs", "r")
    assert not [f for f in os.listdir(run_dir) if "000008" in f]  # no orphaned optimizer file
    assert ckpt.complete_steps(run_dir) == [4]


def test_a_run_that_died_before_its_first_checkpoint_restarts(run_base, monkeypatch, capsys):
    calls = {"n": 0}
    real_step = base_train.MuonAdamW.step

    def dying_step(self, *args):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt  # stands in for a crash: no checkpoint was written yet
        return real_step(self, *args)

    with monkeypatch.context() as mp:
        mp.setattr(base_train.MuonAdamW, "step", dying_step)
        with pytest.raises(SystemExit) as e:
            main(*COMMON[:-4], "--save-every", "0", "--eval-every", "-1")
    assert e.value.code == 130
    run_dir = os.path.join(run_base, "runs", "r")
    assert steps_of(os.path.join(run_dir, "metrics.jsonl")) == [0, 1, 2] and not ckpt.complete_steps(run_dir)
    main(*COMMON[:-4], "--save-every", "0", "--eval-every", "-1")  # the same command again: starts over
    assert "has no complete checkpoint: starting it again" in capsys.readouterr().out
    assert steps_of(os.path.join(run_dir, "metrics.jsonl")) == list(range(9))
    assert steps_of(os.path.join(run_dir, "metrics.jsonl.bak-0")) == [0, 1, 2]


def test_torn_last_metrics_line_is_tolerated_and_kept(run_base):
    run_dir = main(*COMMON)
    metrics = os.path.join(run_dir, "metrics.jsonl")
    with open(metrics, "a") as f:
        f.write('{"step": 9, "train_lo')  # what a kill in the middle of a write leaves
    main(*COMMON, "--resume", "4")
    assert steps_of(metrics) == list(range(9))
    assert open(metrics + ".bak-4").read().endswith('{"step": 9, "train_lo\n')


def test_lock_refuses_a_second_process(run_base, script_error):
    run_dir = os.path.join(run_base, "runs", "r")
    with ckpt.run_lock(run_dir, "a test"):
        err = script_error(cli, *COMMON)
    assert "is in use by pid" in err and "a test" in err
    assert not os.path.exists(os.path.join(run_dir, "metrics.jsonl"))
    main(*COMMON)  # released on exit


def test_two_processes_on_one_run_exactly_one_proceeds(run_base):
    env = dict(os.environ, NANOCHAT_BASE_DIR=str(run_base), OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "scripts.base_train",
        *TINY_TRAIN,
        *COMMON[:3],
        "30",
        *COMMON[4:],
        "--resume",
        "latest",
    ]
    procs = [
        subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    results = [p.communicate(timeout=240) for p in procs]
    codes = sorted(p.returncode for p in procs)
    assert codes == [0, 1], results
    err = next(e for p, (_, e) in zip(procs, results) if p.returncode == 1)
    # "in use by pid N (training)", or "in use by another process" when it lost the race before the pid was written
    assert "is in use by" in err.strip().splitlines()[-1]
    assert steps_of(os.path.join(run_base, "runs", "r", "metrics.jsonl")) == list(range(31))


def test_leftover_temp_files_are_cleaned_on_the_next_start(run_base):
    run_dir = main(*COMMON)
    stale = os.path.join(run_dir, ".tmp-model_000012.ptabc123")
    open(stale, "wb").write(b"half a checkpoint")
    main(*COMMON, "--resume", "latest")
    assert not os.path.exists(stale)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--head-dim", "0"], "--head-dim must be positive"),
        (["--head-dim", "-64"], "--head-dim must be positive"),
        (["--device-batch-size", "0"], "--device-batch-size must be positive"),
        (["--max-seq-len", "0"], "--max-seq-len must be positive"),
        (["--model-dim", "0"], "--model-dim must be a positive number"),
        (["--matrix-lr", "0"], "--matrix-lr must be positive"),
        (["--window-pattern", "X"], "--window-pattern takes the letters L"),
        (["--target-flops", "inf", "--num-iterations", "-1"], "--target-flops must be a positive number, or -1"),
        (["--target-flops", "nan", "--num-iterations", "-1"], "--target-flops must be a positive number, or -1"),
        (["--final-lr-frac", "-3"], "--final-lr-frac must be in [0, 1]"),
        (["--resume", "soon"], "--resume takes 'latest' or a step number"),
        (["--run", "."], "'.' is not a run name"),
        (["--run", ".."], "'..' is not a run name"),
        (["--arch", "nag", "--nag-mod-floor", "-1"], "--nag-mod-floor must be >= 0"),
        (["--preset", "gpt5"], "unknown preset 'gpt5'"),
        (["--run", ""], "'' is not a run name"),
        (["--arch", "nag", "--nag-gate-lr", "0"], "--nag-gate-lr must be positive"),
        (["--arch", "nag", "--nag-temp-gain-lr", "-1"], "--nag-temp-gain-lr must be positive"),
        (["--change-settings"], "--change-settings only applies with --resume"),
    ],
)
def test_bad_values_are_one_line(run_base, script_error, argv, message):
    assert message in script_error(cli, "--run", "v", "--num-iterations", "2", *argv)
    assert not os.path.exists(os.path.join(run_base, "runs", "v", "config.json"))
    assert not os.path.exists(os.path.join(run_base, "runs", "v", "metrics.jsonl"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_without_cuda_is_one_line(run_base, script_error):
    assert "sees no CUDA device" in script_error(cli, "--run", "v", "--num-iterations", "2", "--device-type", "cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_gpu_preset_on_cpu_is_one_line_unless_asked_for(run_base, script_error):
    # published: 64 × 640, 322M matrix parameters; without a GPU it would train for weeks without a word
    err = script_error(base_train.main, "--preset", "published", "--arch", "nag", "--run", "p")
    assert "--preset published is a GPU configuration" in err and "--device-type cpu" in err
    # asked for explicitly, the next check is the tokenizer: the session's has 512 tokens, the preset 32,768
    err = script_error(base_train.main, "--preset", "published", "--arch", "nag", "--run", "p", "--device-type", "cpu")
    assert "32,768-token tokenizer" in err and "has 512" in err
    assert not os.path.exists(os.path.join(run_base, "runs", "p"))


def test_a_run_path_is_a_directory_everywhere(run_base, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_dir = main("--run", "mine/r1", "--num-iterations", "1", "--eval-every", "-1")
    assert run_dir == str(tmp_path / "mine" / "r1") and ckpt.complete_steps(run_dir) == [1]
    assert resolve_run_dir("mine/r1") == run_dir
    assert resolve_run_dir("r1") == os.path.join(run_base, "runs", "r1") == run_path("r1")


def test_a_checkpoint_without_a_tokenizer_fingerprint_is_an_earlier_versions():
    """A meta without fingerprints was once checked on the vocab size alone: now it is one line, an earlier version."""
    tok = types.SimpleNamespace(get_vocab_size=lambda: 512, fingerprint=lambda: "f" * 16)
    meta = {"step": 4, "model_config": {"vocab_size": 512}}
    with pytest.raises(UserError, match="step 4 records no tokenizer fingerprint: a checkpoint of an earlier version"):
        ckpt.check_vocab(meta, tok)
    ckpt.check_vocab({**meta, "fingerprints": {"tokenizer": "f" * 16}}, tok)  # the format this version writes


@pytest.mark.parametrize("steps, warmdown", [(10, 0.65), (40, 0.65), (50, 0.65), (7, 1.0)])
def test_warmup_and_warmdown_never_overlap(run_base, steps, warmdown):
    args = base_train.parse_args(
        TINY_TRAIN + ["--num-iterations", str(steps), "--warmup-steps", "40", "--warmdown-ratio", str(warmdown)]
    )
    plan = plan_for(args, 512, 1)
    lrm = [lr_multiplier(s, plan) for s in range(steps)]
    assert plan.warmup_steps + plan.warmdown_steps <= steps
    peak = lrm.index(max(lrm))
    assert max(lrm) == 1.0  # the warm-up always reaches the full LR
    assert all(a <= b for a, b in zip(lrm[:peak], lrm[1 : peak + 1]))  # rises, then
    assert all(a >= b for a, b in zip(lrm[peak:], lrm[peak + 1 :]))  # falls, never jumps back up
    assert lrm[-1] == pytest.approx(1 / plan.warmdown_steps + (1 - 1 / plan.warmdown_steps) * 0.05)
    assert (
        max(abs(a - b) for a, b in zip(lrm, lrm[1:])) <= 1 / max(1, min(plan.warmup_steps, plan.warmdown_steps)) + 1e-9
    )


def test_eval_every_minus_one_never_evaluates_and_eval_is_capped_at_the_split(run_base, capsys):
    run_dir = main("--run", "e", "--num-iterations", "3", "--eval-every", "-1")
    assert not any("val_bpb" in json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl")))
    run_dir = main("--run", "e2", "--num-iterations", "1", "--eval-every", "1", "--eval-tokens", str(10**9))
    out = capsys.readouterr().out
    assert out.count("fewer than --eval-tokens") == 1
    assert all("val_bpb" in json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl")))


def test_save_every_defaults_to_about_five_saves(run_base):
    run_dir = main("--run", "s", "--num-iterations", "10", "--eval-every", "-1")
    assert ckpt.complete_steps(run_dir) == [2, 4, 6, 8, 10]


# ---------------------------------------------------------------------------
# corrupt files


def test_truncated_model_file_on_resume_names_it_and_the_previous_step(run_base, script_error):
    run_dir = main(*COMMON)
    path = os.path.join(run_dir, "model_000008.pt")
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])
    err = script_error(cli, *COMMON, "--resume", "8")
    assert "model_000008.pt" in err and "damaged" in err and "previous complete step is 4" in err


def test_model_without_meta_is_named_as_incomplete(run_base, script_error):
    run_dir = main(*COMMON)
    os.remove(os.path.join(run_dir, "meta_000008.json"))
    err = script_error(cli, *COMMON, "--resume", "8")
    assert "no complete checkpoint for step 8" in err and "complete steps: [4]" in err


def test_corrupt_tokenizer_files_are_one_line(run_base, tmp_path, monkeypatch, script_error):
    import pickle
    import shutil

    base = tmp_path / "corrupt"
    shutil.copytree(os.path.realpath(run_base / "tokenizer"), base / "tokenizer")
    os.symlink(os.path.realpath(run_base / "base_data"), base / "base_data")
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(base))
    tb = base / "tokenizer" / "token_bytes.pt"
    tb.write_bytes(tb.read_bytes()[:50])
    assert "token_bytes" in script_error(cli, "--run", "c", "--num-iterations", "1")
    (base / "tokenizer" / "tokenizer.pkl").write_bytes(pickle.dumps({"not": "a tokenizer"}))
    assert "not a tokenizer" in script_error(cli, "--run", "c", "--num-iterations", "1")


def test_unwritable_base_dir_is_one_line(run_base, tmp_path, monkeypatch, script_error):
    if os.geteuid() == 0:
        # root ignores permission bits: a file where the runs/ directory should be fails the same way
        (run_base / "runs").write_text("not a directory")
    else:
        os.makedirs(run_base / "runs")
        os.chmod(run_base / "runs", 0o500)
    assert "cannot write to" in script_error(cli, "--run", "w", "--num-iterations", "1")


def test_ctrl_c_is_one_line_and_the_run_resumes(run_base):
    # unbuffered: the step lines arrive as they are printed, so the signal lands early in the run
    env = dict(os.environ, NANOCHAT_BASE_DIR=str(run_base), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [
        sys.executable,
        "-m",
        "scripts.base_train",
        *TINY_TRAIN,
        "--run",
        "r",
        "--num-iterations",
        "400",
        "--save-every",
        "5",
        "--eval-every",
        "-1",
        "--resume",
        "latest",
    ]
    # SIGINT back to its default in the child: a shell running these tests in the background ignores it, and a
    # Python started with SIGINT ignored never raises KeyboardInterrupt
    p = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    for line in p.stdout:
        if line.startswith("step 00012"):
            break
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130, err
    assert err.strip().splitlines() == [
        "interrupted: every checkpoint written so far is complete; continue from the newest with --resume latest"
    ]
    run_dir = os.path.join(run_base, "runs", "r")
    last = ckpt.latest_step(run_dir)
    assert 10 <= last < 400 and not [f for f in os.listdir(run_dir) if f.startswith(".tmp-")]
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and f"resumed from step {last}" in out.stdout, out.stderr
    assert steps_of(os.path.join(run_dir, "metrics.jsonl")) == list(range(401))


# ---------------------------------------------------------------------------
# fault injection: kill -9 at random moments, resume, and end where an uninterrupted run ends


def test_kill_9_anywhere_then_resume_equals_an_uninterrupted_run(run_base):
    env = dict(os.environ, NANOCHAT_BASE_DIR=str(run_base), OMP_NUM_THREADS="1")
    args = [
        *TINY_TRAIN,
        "--arch",
        "nag",
        "--num-iterations",
        "300",
        "--save-every",
        "7",
        "--eval-every",
        "10",
        "--nag-gate-log-every",
        "5",
    ]

    def cmd(run, *extra):
        return [sys.executable, "-m", "scripts.base_train", *args, "--run", run, *extra]

    base_train.main([*args, "--run", "straight"])  # the uninterrupted run: in this process, one thread as theirs
    rng = random.Random(0)
    phases = []
    while len(phases) < 5:
        p = subprocess.Popen(
            cmd("killed", "--resume", "latest"),
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        if rng.random() < 0.2:
            time.sleep(rng.uniform(0.5, 2.5))  # during start-up: imports, the lock, the checks, the first writes
        else:
            for line in p.stdout:  # training has begun: kill within the next few dozen steps, saves and evals
                if line.startswith(("step ", "resumed")):
                    break
            time.sleep(rng.uniform(0.0, 0.8))
        assert p.poll() is None, "the run finished before the kill: make it longer"
        p.send_signal(signal.SIGKILL)
        out = p.communicate()[0].strip().splitlines()
        phases.append(out[-1][:30] if out else "(start-up)")
    final = subprocess.run(
        cmd("killed", "--resume", "latest"), cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert final.returncode == 0, final.stdout + final.stderr
    straight, killed = (os.path.join(run_base, "runs", r) for r in ("straight", "killed"))
    a = torch.load(os.path.join(straight, "model_000300.pt"), weights_only=False)["model"]
    b = torch.load(os.path.join(killed, "model_000300.pt"), weights_only=False)["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows_a = [json.loads(line) for line in open(os.path.join(straight, "metrics.jsonl"))]
    rows_b = [json.loads(line) for line in open(os.path.join(killed, "metrics.jsonl"))]
    same = ("step", "tokens", "train_loss", "lr_mult", "val_bpb", "gate")
    assert [{k: r.get(k) for k in same} for r in rows_a] == [{k: r.get(k) for k in same} for r in rows_b]
    assert not [f for f in os.listdir(killed) if f.startswith(".tmp-")]
    print(f"{len(phases)} kills; the last line before each: {phases}")


def test_dataset_with_an_unwritable_base_dir_is_one_line(tmp_path, monkeypatch, script_error):
    from nanochat import dataset

    (tmp_path / "file").write_text("not a directory")
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path / "file" / "base"))
    assert "cannot create the base dir" in script_error(dataset.main, "--offline")
