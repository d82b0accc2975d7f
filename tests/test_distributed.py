"""Data-parallel training under torchrun (gloo on CPU) equals single-process gradient accumulation."""

import os
import sys
import json
import subprocess

import pytest

from conftest import TINY_TRAIN, linked_base

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = TINY_TRAIN + ["--total-batch-size", "512", "--eval-every", "100"]


@pytest.fixture
def base(tiny_base_dir, tmp_path):
    return str(linked_base(tiny_base_dir, tmp_path / "base"))


def launch(base, nproc, *args):
    env = dict(os.environ, NANOCHAT_BASE_DIR=base, OMP_NUM_THREADS="1")
    if nproc == 1:
        cmd = [sys.executable, "-m", "scripts.base_train"]
    else:  # "--" keeps torchrun's own parser away from our flags (--run would clash with --run-path)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m", "scripts.base_train", "--"]
    out = subprocess.run(cmd + TINY + list(args), cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def losses(base, run):
    rows = [json.loads(l) for l in open(os.path.join(base, "runs", run, "metrics.jsonl"))]
    return [r["train_loss"] for r in rows if r["train_loss"] is not None]


# MoD on the MLP only: each micro-batch skips its own lowest-scoring tokens, so one process with two
# micro-batches and two processes with one each make the same decisions (the attention threshold would not:
# it carries over from the previous micro-batch, which differs between the two set-ups, docs/mod.md)
MLP_MOD = ["--mod-rate", "0.2", "--mod-blocks", "mlp"]


@pytest.mark.parametrize("arch", [["gpt"], ["nag"], ["nag", *MLP_MOD], ["gpt", "--mod-router", *MLP_MOD]],
                         ids=["gpt", "nag", "nag-mod", "gpt-router"])
def test_two_processes_equal_grad_accumulation(base, arch):
    single = launch(base, 1, "--arch", *arch, "--run", "single", "--num-iterations", "5")
    assert "grad accum 2" in single
    double = launch(base, 2, "--arch", *arch, "--run", "ddp", "--num-iterations", "5")
    assert "× 2" in double and "grad accum 1" in double
    a, b = losses(base, "single"), losses(base, "ddp")
    assert len(a) == len(b) == 5
    assert max(abs(x - y) for x, y in zip(a, b)) < 1e-5, (a, b)


def test_resume_under_torchrun(base):
    common = ["--arch", "nag", "--num-iterations", "6", "--save-every", "3"]
    launch(base, 2, *common, "--run", "full")
    launch(base, 2, *common, "--run", "full", "--resume", "3")
    run_dir = os.path.join(base, "runs", "full")
    assert sorted(f for f in os.listdir(run_dir) if f.startswith("optim_000003")) == ["optim_000003_rank0.pt", "optim_000003_rank1.pt"]
    launch(base, 2, *common, "--run", "fresh")
    assert max(abs(x - y) for x, y in zip(losses(base, "full"), losses(base, "fresh"))) < 1e-6
