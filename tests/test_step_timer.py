"""Where a step's time goes: a metrics row's parts add up to its step time, each in the right part."""

import os
import re
import json
import time

import pytest
import torch

from conftest import TINY_TRAIN
from scripts import base_train
from nanochat import checkpoint_manager as ckpt
from nanochat.dataloader import MicroBatches
from nanochat.optim import MuonAdamW
from nanochat.step_timer import StepTimer, Readback, biggest, call_ms

# added to every wait for a train micro-batch, optimizer step, evaluation, save
DATA_S, OPTIM_S, EVAL_S, SAVE_S = 0.02, 0.01, 0.05, 0.1
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_timer_parts_tile_the_interval():
    timer = StepTimer("cpu")
    time.sleep(0.01)
    timer.mark("data")
    timer.mark("fwd_bwd")
    time.sleep(0.02)
    timer.mark("data")  # a phase may come back: its parts add up
    parts, wall = timer.read()
    assert list(parts) == ["data", "fwd_bwd"] and parts["data"] >= 0.03 and abs(sum(parts.values()) - wall) < 1e-3
    time.sleep(0.01)
    timer.mark("save")
    parts, _ = timer.read()  # the next interval starts at the last mark of the one before
    assert list(parts) == ["save"] and 0.01 <= parts["save"] < 0.5
    assert biggest({"fwd_bwd": 3.0, "data": 1.0}) == "fwd+bwd 75%" and biggest({}) == ""


def test_call_ms_times_the_call_alone():
    """The benchmarks' timer on the CPU (the host clock; CUDA events on a GPU): setup runs before every call, warm-up
    ones included, and is not timed; the figure is the median call's."""
    setups, calls = [], []
    ms = call_ms(
        lambda: calls.append(time.sleep(0.005)),
        "cpu",
        reps=3,
        warmup=1,
        setup=lambda: setups.append(time.sleep(0.03)),
    )
    assert len(setups) == len(calls) == 4 and 5 <= ms < 25


def test_readback_gives_the_value_put_one_step_before():
    late = Readback("cpu")
    assert late.take() is None
    t = torch.tensor([1.5, 0.0])
    late.put(t, (3, ["w"]))
    t.fill_(7.0)  # the step goes on with its own tensors: the value read is the one put
    assert late.take() == ([1.5, 0.0], (3, ["w"])) and late.take() is None


def test_breakdown_adds_up_to_the_step_time(run_base, monkeypatch, capsys):
    """A run with every part slowed down: each row's parts (eval and save aside) are its step time, time put into a
    part lands in that part, and the rows together cover the wall clock between optimizer steps."""
    ends = []
    real_step, real_take, real_eval, real_save = (
        MuonAdamW.step,
        MicroBatches.take,
        base_train.evaluate_bpb_shared,
        ckpt.save_checkpoint,
    )

    def slow_step(self, *args, **kwargs):
        time.sleep(OPTIM_S)
        real_step(self, *args, **kwargs)
        ends.append(time.perf_counter())

    def slow_take(self):  # a micro-batch the loader's thread has not packed yet: the step waits in take
        time.sleep(DATA_S)
        return real_take(self)

    monkeypatch.setattr(MuonAdamW, "step", slow_step)
    monkeypatch.setattr(MicroBatches, "take", slow_take)
    monkeypatch.setattr(base_train, "evaluate_bpb_shared", lambda *a: time.sleep(EVAL_S) or real_eval(*a))
    monkeypatch.setattr(ckpt, "save_checkpoint", lambda *a: time.sleep(SAVE_S) or real_save(*a))
    run_dir = base_train.main(
        TINY_TRAIN + ["--run", "bd", "--num-iterations", "8", "--eval-every", "4", "--save-every", "3"]
    )
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))][1:]
    assert [r["step"] for r in rows] == list(range(1, 9))
    for r in rows:
        t = r["time"]
        assert {"fwd_bwd", "optim", "sync_log"} <= set(t)
        # each step takes its micro-batch, packed ahead by the loader's thread, or waits for it
        assert t["data"] >= DATA_S, t
        # a save shows in the next row
        assert ("eval" in t) == ("val_bpb" in r) and ("save" in t) == (r["step"] - 1 in (3, 6))
        training = sum(v for k, v in t.items() if k not in ("eval", "save"))
        assert abs(training - 256 / r["tok_per_sec"]) < 1e-6, r  # the step time behind tok/s and elapsed
        assert t["optim"] >= OPTIM_S and t.get("eval", EVAL_S) >= EVAL_S and t.get("save", SAVE_S) >= SAVE_S, t
    # independent of the timer: the rows of steps 2..7, eval and save included, span the wall clock from the end of
    # step 1's optimizer step to the end of step 7's (each row is read a logging's worth of time after it)
    covered = sum(sum(r["time"].values()) for r in rows[1:7])
    measured = ends[6] - ends[0]
    assert abs(covered - measured) < 0.03 + 0.05 * measured, (covered, measured)  # < a save: one left out would show
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step 0000")]
    assert all(
        re.search(r" \| (data|fwd\+bwd|optim|sync\+log|eval|save) \d+% \| ", line) for line in lines if "tok/s" in line
    )
