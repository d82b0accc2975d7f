"""Data-parallel training under torchrun (gloo on CPU) equals single-process gradient accumulation."""

import os
import sys
import json
import math
import subprocess

import pytest

from conftest import PROCESSES, TINY_TRAIN, linked_base

pytestmark = PROCESSES  # every test here starts a process group (tests/conftest.py)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = TINY_TRAIN + ["--total-batch-size", "512", "--eval-every", "100"]


@pytest.fixture
def base(tiny_base_dir, tmp_path):
    return str(linked_base(tiny_base_dir, tmp_path / "base"))


def launch(base, nproc, *args, module="scripts.base_train", path=None):
    """base_train (or `module`, found on `path` too) in one process or under torchrun; its stdout."""
    env = dict(os.environ, NANOCHAT_BASE_DIR=base, OMP_NUM_THREADS="1")
    if path:
        env["PYTHONPATH"] = os.pathsep.join([str(path), REPO] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    if nproc == 1:
        cmd = [sys.executable, "-m", module]
    else:  # "--" keeps torchrun's own parser away from our flags (--run would clash with --run-path)
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            "-m",
            module,
            "--",
        ]
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


# GPT: tests/test_multinode.py, with two torchrun agents standing in for two nodes; NAG-MoD and the router-MoD GPT:
# test_sublayer_skipped_on_one_rank_equals_grad_accumulation below, the harder case of the same equality
@pytest.mark.parametrize("arch", [["nag"]], ids=["nag"])
def test_two_processes_equal_grad_accumulation(base, arch):
    single = launch(base, 1, "--arch", *arch, "--run", "single", "--num-iterations", "5")
    assert "grad accum 2" in single
    double = launch(base, 2, "--arch", *arch, "--run", "ddp", "--num-iterations", "5")
    assert "× 2" in double and "grad accum 1" in double
    a, b = losses(base, "single"), losses(base, "ddp")
    assert len(a) == len(b) == 5
    assert max(abs(x - y) for x, y in zip(a, b)) < 1e-5, (a, b)
    # the val bpb of the log too: both read the same val batches, shared between the two ranks. At step 0 the
    # weights are the same, so is the bpb (before the batches were shared: split by rank, another number);
    # at the end the weights differ by the float noise the losses show
    va, vb = val_bpbs(base, "single"), val_bpbs(base, "ddp")
    assert len(va) == len(vb) == 2 and abs(va[0] - vb[0]) < 1e-9 and abs(va[1] - vb[1]) < 1e-5, (va, vb)


def val_bpbs(base, run):
    rows = [json.loads(l) for l in open(os.path.join(base, "runs", run, "metrics.jsonl"))]
    return [r["val_bpb"] for r in rows if r.get("val_bpb") is not None]


# base_train where layer 0's attention skips every token of the second shard's micro-batch (rank 1 under
# torchrun, micro-batch 1 of one process): its scores are -inf there. Each micro-batch's attention threshold
# comes from its own scores (the threshold is forgotten after each forward), so that both set-ups make the
# same decisions; the carried-over threshold of real training would differ between them (above).
SKIP_ONE_SUBLAYER = """
import os, runpy, torch
from nag import mod

decide, finish = mod.Thresholds.decide, mod.Thresholds.finish
forwards = [0]


def forced(self, kind, layer, score, capacity):
    shard = int(os.environ["RANK"]) if "RANK" in os.environ else forwards[0] % 2
    if self.training and kind == "attn" and layer == 0 and shard == 1:
        score = torch.full_like(score, -float("inf"))
    return decide(self, kind, layer, score, capacity)


def forget(self):
    forwards[0] += self.training
    finish(self)
    self.counts[0] = 0


mod.Thresholds.decide, mod.Thresholds.finish = forced, forget
runpy.run_module("scripts.base_train", run_name="__main__")
"""


@pytest.mark.parametrize("arch", [["nag"], ["gpt-router"]], ids=["nag-mod", "gpt-router"])
def test_sublayer_skipped_on_one_rank_equals_grad_accumulation(base, tmp_path, arch):
    # DDP (find_unused_parameters=False) needs every parameter to get a gradient on every rank: a skipped
    # sub-layer still runs on its capacity of padded rows whose result is dropped (nag/mod.py)
    (tmp_path / "skip_one_sublayer.py").write_text(SKIP_ONE_SUBLAYER)
    common = ["--arch", *arch, "--mod-rate", "0.2", "--mod-blocks", "both", "--num-iterations", "4"]
    single = launch(base, 1, *common, "--run", "single", module="skip_one_sublayer", path=tmp_path)
    double = launch(base, 2, *common, "--run", "ddp", module="skip_one_sublayer", path=tmp_path)
    assert "grad accum 2" in single and "grad accum 1" in double
    a, b = losses(base, "single"), losses(base, "ddp")
    assert len(a) == len(b) == 4 and all(math.isfinite(x) for x in a)
    assert max(abs(x - y) for x, y in zip(a, b)) < 1e-5, (a, b)
    # the forced sub-layer did skip every token of micro-batch 1: at least half of its tokens (rank 0, which logs
    # under torchrun, skips its own share only)
    rows = [json.loads(l) for l in open(os.path.join(base, "runs", "single", "metrics.jsonl"))][1:]
    assert all(r["mod"]["skip"]["0.attn"] >= 0.5 for r in rows)


def test_data_seed_two_processes_equal_grad_accumulation(base):
    # the shuffled order is dealt to the shards before they are spread over processes and micro-steps
    common = ["--data-seed", "7", "--num-iterations", "4"]
    launch(base, 1, *common, "--run", "single")
    launch(base, 2, *common, "--run", "ddp")
    a, b = losses(base, "single"), losses(base, "ddp")
    assert len(a) == len(b) == 4 and max(abs(x - y) for x, y in zip(a, b)) < 1e-5, (a, b)
    # that the seed reorders the data at all: tests/test_dataloader.py
