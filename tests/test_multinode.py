"""Runs of several processes on CPU (gloo): nodes, restarts, resumes and stops.

Two torchrun agents standing in for two nodes, srun's variables, a shared
run directory checked, restarts after a killed worker, resumes on another process count, SIGTERM and a stopped rank."""

import io
import os
import sys
import json
import contextlib
import time
import shutil
import signal
import socket
import subprocess

import pytest
import torch

from conftest import PROCESSES, TINY_TRAIN, linked_base
from nanochat import checkpoint_manager as ckpt
from nanochat.common import UserError, dist_init, get_dist_info
from nanochat.distributed import EXIT_HUNG, EXIT_PREEMPTED

# every test here starts a process group (tests/conftest.py); the single-process runs train here, on one thread as
# each rank does
pytestmark = [PROCESSES, pytest.mark.usefixtures("one_torch_thread")]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = TINY_TRAIN + ["--total-batch-size", "512", "--eval-every", "100"]  # 2 micro-steps of 4 × 64 on one process
LAUNCH_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "SLURM_STEP_NUM_TASKS",
    "SLURM_PROCID",
    "SLURM_LOCALID",
)


@pytest.fixture
def base(tiny_base_dir, tmp_path):
    return str(linked_base(tiny_base_dir, tmp_path / "base"))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(base, **extra):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    return dict(env, NANOCHAT_BASE_DIR=base, OMP_NUM_THREADS="1", **extra)


def train_cmd(*args):
    return ["-m", "scripts.base_train", "--", *TINY, *args]


def run_one(base, *args):
    """base_train in one process, this one (a reference costs its training, not another start of torch); its
    stdout."""
    from scripts import base_train

    out = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out):
        mp.setenv("NANOCHAT_BASE_DIR", base)
        for k in LAUNCH_VARS:
            mp.delenv(k, raising=False)
        base_train.main([*TINY, *args])
    return out.getvalue()


def start_ranks(base, world, *args, slurm=False):
    """`world` processes started by hand, as srun (SLURM_* variables) or any launcher (RANK, WORLD_SIZE, ...) would."""
    port, procs = free_port(), []
    for r in range(world):
        names = (
            {"SLURM_STEP_NUM_TASKS": world, "SLURM_PROCID": r, "SLURM_LOCALID": r}
            if slurm
            else {"RANK": r, "LOCAL_RANK": r, "WORLD_SIZE": world}
        )
        env = clean_env(base, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **{k: str(v) for k, v in names.items()})
        procs.append(
            subprocess.Popen(
                [sys.executable, *train_cmd(*args)],
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    return procs


def torchrun(base, torchrun_args, *args, env=None):
    cmd = [sys.executable, "-m", "torch.distributed.run", *torchrun_args, *train_cmd(*args)]
    return subprocess.Popen(
        cmd, cwd=REPO, env=env or clean_env(base), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def finish(procs, timeout=300):
    return [(p.wait(timeout), p.stdout.read()) for p in procs]


def rows(base, run):
    return [json.loads(line) for line in open(os.path.join(base, "runs", run, "metrics.jsonl"))]


def losses(base, run):
    return [r["train_loss"] for r in rows(base, run) if r["train_loss"] is not None]


def weights(base, run, step):
    return ckpt.load_model_file(os.path.join(base, "runs", run), step)["model"]


def same_weights(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def wait_for(condition, timeout=120, what="a condition"):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def logged_steps(base, run):
    path = os.path.join(base, "runs", run, "metrics.jsonl")
    return sum(1 for _ in open(path)) - 1 if os.path.exists(path) else -1


def test_rank_detection_torchrun_srun_and_batch_shell(monkeypatch):
    for k in LAUNCH_VARS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "0")  # the batch shell of an sbatch job: one process, whatever the job's size
    monkeypatch.setenv("SLURM_NTASKS", "16")
    assert get_dist_info() == (False, 0, 0, 1)
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "16")  # a task of `srun --ntasks 16`
    monkeypatch.setenv("SLURM_PROCID", "9")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    assert get_dist_info() == (True, 9, 1, 16)
    with pytest.raises(UserError, match="MASTER_ADDR / MASTER_PORT are not set"):
        dist_init("cpu")
    monkeypatch.setenv("RANK", "3")  # torchrun inside srun (one agent per node): torchrun's variables win
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert get_dist_info() == (True, 3, 3, 8)


def test_two_agents_equal_one_process(base):
    """Two torchrun agents meeting at a c10d rendezvous (two nodes of one process each) train exactly what one
    process with two micro-steps does."""
    run_one(base, "--run", "single", "--num-iterations", "4")
    rdzv = [
        "--nnodes",
        "2",
        "--nproc_per_node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{free_port()}",
        "--rdzv-id",
        "t",
    ]
    results = finish([torchrun(base, rdzv, "--run", "nodes", "--num-iterations", "4") for _ in range(2)])
    assert all(rc == 0 for rc, _ in results), results
    assert losses(base, "nodes") == losses(base, "single")
    assert same_weights(weights(base, "nodes", 4), weights(base, "single", 4))
    bpbs = [[r["val_bpb"] for r in rows(base, run) if "val_bpb" in r] for run in ("nodes", "single")]
    assert len(bpbs[0]) == 2 and bpbs[0] == bpbs[1]  # the val batches are shared between the ranks, not split by rank


def test_run_directory_not_shared_is_refused(tiny_base_dir, tmp_path):
    """Each "node" with its own base dir: before, both exited 0 with no complete checkpoint anywhere."""
    bases = [str(linked_base(tiny_base_dir, tmp_path / f"node{i}")) for i in range(2)]
    rdzv = [
        "--nnodes",
        "2",
        "--nproc_per_node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{free_port()}",
        "--rdzv-id",
        "t",
    ]
    results = finish([torchrun(b, rdzv, "--run", "x", "--num-iterations", "4") for b in bases])
    assert all(rc != 0 for rc, _ in results)
    for _, out in results:
        assert "error: rank(s) 1 (" in out and "must be one directory on a filesystem shared by every node" in out, out[
            -2000:
        ]
    run_dirs = [os.path.join(b, "runs", "x") for b in bases]
    assert not any(f.startswith("model_") for d in run_dirs if os.path.isdir(d) for f in os.listdir(d))


def test_killed_worker_restarts_and_ends_bit_identical(base):
    """A worker killed twice under torchrun with restarts: each restart resumes from the newest checkpoint, none hangs,
    and the run ends with the weights and losses of an uninterrupted one."""
    from scripts.speedrun import LAUNCH_ENV, launch_command

    common = ["--num-iterations", "30", "--save-every", "5", "--resume", "latest"]
    launcher = launch_command(2, nnodes=1, max_restarts=3)
    assert launcher[0] == "torchrun"
    env = clean_env(base, **LAUNCH_ENV)
    job = torchrun(base, launcher[1:-1], "--run", "killed", *common, env=env)
    lock = os.path.join(base, "runs", "killed", ".lock")
    # rank 0's worker, named in the run's lock ("" mid-write)
    holder = lambda: (open(lock).read().split() + ["", ""])[1]
    for kill_after in (8, 18):  # steps: each kill lands past a checkpoint
        wait_for(lambda: logged_steps(base, "killed") >= kill_after, what=f"step {kill_after}")
        killed = holder()
        os.kill(int(killed), signal.SIGKILL)
        wait_for(lambda: holder() not in (killed, ""), what="the restart")  # the new rank 0 holds the lock
    rc, out = finish([job], timeout=200)[0]
    assert rc == 0, out[-3000:]
    assert out.count("resumed from step") == 2  # once per restart (rank 0 prints it)
    run_one(base, "--run", "whole", *common)
    assert losses(base, "killed") == losses(base, "whole")
    assert same_weights(weights(base, "killed", 30), weights(base, "whole", 30))


def test_sigterm_saves_on_every_rank_and_resume_on_other_process_counts(base, script_error, capsys):
    """srun-style ranks; SIGTERM to rank 1 only: both stop after the same step with a complete checkpoint there and
    exit EXIT_PREEMPTED; the run then continues on one process, and a one-process checkpoint on two, each ending
    where an uninterrupted one-process run does."""
    common = ["--num-iterations", "12", "--save-every", "3"]
    procs = start_ranks(base, 2, "--run", "stopped", *common, slurm=True)
    wait_for(lambda: logged_steps(base, "stopped") >= 4, what="step 4")
    procs[1].send_signal(signal.SIGTERM)
    (rc0, out0), (rc1, out1) = finish(procs)
    assert rc0 == rc1 == EXIT_PREEMPTED, out0[-2000:] + out1[-2000:]
    stopped_at = rows(base, "stopped")[-1]["step"]
    assert 4 <= stopped_at < 12 and f"stopped by SIGTERM after step {stopped_at}" in out0
    run_dir = os.path.join(base, "runs", "stopped")
    assert ckpt.complete_steps(run_dir)[-1] == stopped_at  # both ranks' files of the stop's checkpoint
    assert {f"optim_{stopped_at:06d}_rank{r}.pt" for r in (0, 1)} <= set(os.listdir(run_dir))

    run_one(base, "--run", "whole", *common)
    out = run_one(base, "--run", "stopped", *common, "--resume", "latest")  # 2 → 1 process
    assert f"resumed from step {stopped_at}" in out
    assert losses(base, "stopped") == losses(base, "whole")
    assert same_weights(weights(base, "stopped", 12), weights(base, "whole", 12))
    segment = json.load(open(os.path.join(run_dir, "config.json")))["segments"][-1]
    assert segment["start_step"] == stopped_at and segment["changes"] == {"world_size": {"then": 2, "now": 1}}

    up = os.path.join(base, "runs", "up")  # 1 → 2: the uninterrupted run's step-6 checkpoint, continued on two ranks
    os.makedirs(up)
    for name in ("config.json", "meta_000006.json", "model_000006.pt", "optim_000006_rank0.pt"):
        shutil.copy(os.path.join(base, "runs", "whole", name), up)
    results = finish(start_ranks(base, 2, "--run", "up", *common, "--resume", "6"))
    assert all(rc == 0 for rc, _ in results), results[0][1][-2000:]
    assert same_weights(weights(base, "up", 12), weights(base, "whole", 12))

    # another micro-batch size: no remap exists
    capsys.readouterr()
    refuse = lambda argv: run_one(base, *argv)
    err = script_error(refuse, "--run", "up", *common, "--resume", "6", "--device-batch-size", "2", "--change-settings")
    assert "its data was cut into 2 shards" in err, err


def test_stopped_rank_is_named_within_the_timeout(base):
    """A rank that stops (SIGSTOP: a hung GPU, a swapping node) ends the run within --step-timeout, naming that rank."""
    procs = start_ranks(base, 2, "--run", "hang", "--num-iterations", "2000", "--step-timeout", "3")
    wait_for(lambda: logged_steps(base, "hang") >= 3, what="step 3")
    procs[1].send_signal(signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        rc, out = finish(procs[:1], timeout=60)[0]
        waited = time.monotonic() - stopped
    finally:
        procs[1].kill()
        procs[1].wait()
    assert rc == EXIT_HUNG, out[-2000:]
    assert "error: rank(s) 1 stopped, hung or died in a training step (step" in out, out[-2000:]
    assert waited < 3 + 2 + 10, waited  # the timeout, the others' grace to report, and start-up slack


def test_slurm_script_runs_speedrun_on_every_node(tmp_path):
    """runs/slurm_pair.sbatch with stand-ins for scontrol and srun (which runs the task of node 1 here): speedrun
    gets the node count, this node's rank, the first node's address and the user's flags."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/bash\nprintf 'gpu-a\\ngpu-b\\n'\n")
    (bin_dir / "srun").write_text("#!/bin/bash\nwhile [[ $1 == --* ]]; do shift 2; done\nSLURM_NODEID=1 exec \"$@\"\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = clean_env(
        str(tmp_path / "base"),
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        SLURM_NNODES="2",
        SLURM_JOB_NODELIST="gpu-[a-b]",
        SLURM_SUBMIT_DIR=REPO,
        SLURM_STEP_NUM_TASKS="2",
        SLURM_PROCID="1",
    )
    out = subprocess.run(
        ["bash", "runs/slurm_pair.sbatch", "--dry-run", "--seeds", "1,2"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "per node × 2 nodes = 16, this is node 1" in out.stderr
    assert (
        "--nnodes=2 --rdzv-backend=c10d --rdzv-endpoint=gpu-a:29500" in out.stderr and "gpt-published-s2" in out.stderr
    )


RANK0_DECIDES = """
import torch
from nanochat.common import UserError, dist_init
from nanochat.distributed import rank0_decides
_, rank, _, _, _ = dist_init("cpu")
print("value", rank0_decides(lambda: 100 + rank, True))  # each rank would find another value: rank 0's wins
def refuse():
    raise UserError("rank 0 refuses")
try:
    rank0_decides(refuse, True)
except UserError as e:
    print("error", e)
torch.distributed.barrier()
torch.distributed.destroy_process_group()  # gloo aborts an exit that skips this, or tears a pair down mid-use
"""


def test_rank0_decides_for_every_rank(tmp_path):
    """Before, each rank chose its own start step (node A resumed at its checkpoint, node B started at 0, and the
    first collective failed); now rank 0's answer, or its refusal, reaches every rank."""
    port, procs = free_port(), []
    for r in range(2):
        env = clean_env(
            str(tmp_path),
            RANK=str(r),
            LOCAL_RANK=str(r),
            WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", RANK0_DECIDES],
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    for rc, out in finish(procs, timeout=60):
        assert rc == 0 and out.split("\n")[:2] == ["value 100", "error rank 0 refuses"], out
