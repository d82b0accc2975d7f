"""base_train's own training step on the meta device, for every arch.

No CPU tensor mixed into a device step and no
hidden host read, the reads it does make counted; and the device-side veto of a non-finite update (MuonAdamW's gate)."""

import sys
import types

import pytest
import torch

from conftest import TINY_TRAIN
from nag.archs import plan_for
from nanochat import step_timer
from nanochat.dataloader import MicroBatches
from nanochat.optim import MuonAdamW
from nanochat.step_timer import Readback, StepTimer
from scripts import base_train

META = torch.device("meta")
LOG_EVERY = 2  # steps 1, 3 log no row; 2, 4 do
ARCHS = {  # what the four training paths need: (flags, reads per logged step beyond the one of the loss and checks)
    "gpt": ([], 0),
    "nag": (["--arch", "nag", "--nag-gate-log-every", "4"], 0),
    # its skip rates
    "nag-mod": (["--arch", "nag", "--mod-blocks", "mlp", "--mod-rate", "0.25", "--nag-gate-log-every", "0"], 1),
    "router-mod": (["--arch", "gpt-router", "--mod-blocks", "mlp", "--mod-rate", "0.25"], 1),
    # attention skipping too: each row's queries are packed to a fixed capacity (nag/mod.py), no read per layer
    "nag-mod-attn": (["--arch", "nag", "--mod-blocks", "both", "--mod-rate", "0.25", "--nag-gate-log-every", "0"], 1),
}


class MetaGather(MuonAdamW):
    """The sharded optimizer's math as rank 0 of 2 runs it, with its all-gather answered in place (no process group):
    the chunking, padding and copies back are the real ones."""

    def all_gather(self, out, inp):
        out.copy_(torch.cat([inp] * (out.size(0) // inp.size(0))))
        return types.SimpleNamespace(wait=lambda: None)


def meta_loader(batch, seq_len, vocab):
    while True:  # token ids with no values: whatever reads them on the host raises
        x = torch.empty((batch, seq_len), dtype=torch.long, device=META)
        yield x, torch.empty_like(x), {"epoch": 0, "dropped_tokens": 0}


def meta_run(flags):
    args = base_train.parse_args(
        TINY_TRAIN + flags + ["--num-iterations", "6", "--eval-every", "-1", "--log-every", str(LOG_EVERY)]
    )
    plan = plan_for(args, 512, 1)
    model = plan.model
    model.to_empty(device=META)
    model.init_weights()
    model.set_compute_dtype(torch.float32)
    optimizer = MetaGather(plan.optimizer_groups(args), rank=0, world_size=2, compile=False)
    batches = MicroBatches(
        [meta_loader(args.device_batch_size, args.max_seq_len, 512) for _ in range(plan.grad_accum)], META
    )
    return base_train.Run(
        args=args,
        plan=plan,
        record={},
        run_dir=None,
        device=META,
        rank=0,
        world_size=1,
        model=model,
        optimizer=optimizer,
        forward=model,
        eval_forward=model,
        ddp=None,
        batches=batches,
        start=0,
        elapsed=0.0,
        tokenizer=None,
        token_bytes=None,
        trackers=None,
        stop=types.SimpleNamespace(requested=False),
    )


@pytest.mark.parametrize("arch", list(ARCHS))
def test_the_training_step_runs_on_the_meta_device_with_one_read_per_logged_step(arch, monkeypatch):
    flags, extra_reads = ARCHS[arch]
    reads = []

    def fake_read(tensor):
        # every host read of a step goes through read_values; the meta tensor has a shape, no values: ones stand in,
        # with SIGTERM's flag (the second of the step's checks) off
        caller = sys._getframe(1).f_code.co_name
        reads.append(caller)
        values = torch.ones(tensor.shape).tolist()
        if caller in ("train_step", "take"):
            values[1] = 0.0
        return values

    monkeypatch.setattr(step_timer, "read_values", fake_read)

    run = meta_run(flags)
    unlogged, stop_flag, timer = Readback(META), torch.zeros((), device=META), StepTimer(META)
    weights = {n: p for n, p in run.model.named_parameters()}
    per_step = []
    for step in range(4):
        reads.clear()
        done = base_train.train_step(run, step, unlogged, stop_flag, timer)
        if done.loss is not None:
            base_train.step_row(run, step + 1, done.loss, done.lrm, done.x)  # the model's own measures and telemetry
        per_step.append(list(reads))
    assert all(p.device == META and p.grad is None for p in weights.values())
    # a step that logs no row reads nothing now: the previous one's checks at most, copied a step ago (Readback)
    for unlogged_step in (0, 2):
        assert per_step[unlogged_step].count("train_step") == 0 and len(per_step[unlogged_step]) <= 1, per_step
    # a logged step: its loss and checks once, plus what the model measured over the step
    for logged_step in (1, 3):
        now = [c for c in per_step[logged_step] if c != "take"]
        assert now.count("train_step") == 1 and len(now) == 1 + extra_reads + (arch == "nag" and logged_step == 3), (
            per_step
        )
        assert per_step[logged_step].count("take") == 1  # the unlogged step before it, read during this one
    assert ("collect_telemetry" in per_step[3]) == (arch == "nag")  # step 4: the gate telemetry's cadence


def test_a_cpu_tensor_in_the_meta_step_is_caught(monkeypatch):
    """The twin can fail: a non-scalar CPU tensor mixed into the step (here: the stop flag) raises on the meta
    device."""
    monkeypatch.setattr(step_timer, "read_values", lambda t: torch.ones(t.shape).tolist())
    run = meta_run([])
    with pytest.raises(RuntimeError, match="meta|device"):
        base_train.train_step(run, 0, Readback(META), torch.zeros(1), StepTimer(META))


def test_a_host_read_in_the_meta_step_is_caught(monkeypatch):
    """...and so does a read that bypasses read_values (an .item() in the optimizer step)."""
    monkeypatch.setattr(step_timer, "read_values", lambda t: torch.ones(t.shape).tolist())
    run = meta_run([])
    original = run.optimizer.step
    monkeypatch.setattr(run.optimizer, "step", lambda gate=None: (gate.item(), original(gate)))
    with pytest.raises((RuntimeError, NotImplementedError)):
        base_train.train_step(run, 1, Readback(META), torch.zeros((), device=META), StepTimer(META))


# ----- the device-side veto: MuonAdamW.step(gate) -----


def optimizer_and_grads(seed, world_size=1, compile=False):
    g = torch.Generator().manual_seed(seed)
    mats = [torch.nn.Parameter(torch.randn(16, 8, generator=g)) for _ in range(3)]
    small = [torch.nn.Parameter(torch.randn(5, generator=g)), torch.nn.Parameter(torch.randn(4, 3, generator=g))]
    opt = (MetaGather if world_size > 1 else MuonAdamW)(
        [
            dict(kind="muon", params=mats, lr=0.02, momentum=0.95, weight_decay=0.1),
            dict(kind="adamw", params=small, lr=0.01, betas=(0.8, 0.95), weight_decay=0.01),
        ],
        rank=0,
        world_size=world_size,
        compile=compile,
    )
    params = mats + small
    grads = [[torch.randn(p.shape, generator=g) for p in params] for _ in range(3)]
    return opt, params, grads


def snapshot(opt, params):
    state = [v.clone() for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    return [p.detach().clone() for p in params], state


@pytest.mark.parametrize("world_size", [1, 2])
def test_gate_true_is_the_ungated_step_bit_for_bit_and_false_changes_nothing(world_size):
    opt_a, pa, grads = optimizer_and_grads(0, world_size)
    opt_b, pb, _ = optimizer_and_grads(0, world_size)
    for step, gs in enumerate(grads):
        for p, q, g in zip(pa, pb, gs):
            p.grad, q.grad = g.clone(), g.clone()
        opt_a.step()
        opt_b.step(torch.tensor(True))
        assert all(torch.equal(p, q) for p, q in zip(pa, pb)), step
    # a non-finite gradient in one matrix and one small tensor: with the gate off nothing moves, NaN included
    before = snapshot(opt_b, pb)
    for i, q in enumerate(pb):
        q.grad = torch.full_like(q, float("nan")) if i in (1, 3) else torch.randn_like(q)
    opt_b.step(torch.tensor(False))
    after = snapshot(opt_b, pb)
    assert all(torch.equal(a, b) for a, b in zip(before[0] + before[1], after[0] + after[1]))
    # the same gradients ungated poison the weights: the veto is what kept them
    for p, q in zip(pa, pb):
        p.grad = q.grad.clone()
    opt_a.step()
    assert not all(torch.isfinite(p).all() for p in pa)


def test_gate_under_the_compiled_update(monkeypatch):
    """The compiled update (inductor on the CPU, as on CUDA): the gate is a graph input, False keeps every value."""
    torch._dynamo.reset()
    opt, params, grads = optimizer_and_grads(1, compile=True)
    monkeypatch.setattr("nanochat.optim.FUSE_MIN_NUMEL", 1)  # the small AdamW tensors compiled too
    for p, g in zip(params, grads[0]):
        p.grad = g
    opt.step(torch.tensor(True))
    before = snapshot(opt, params)
    for p in params:
        p.grad = torch.full_like(p, float("inf"))
    opt.step(torch.tensor(False))
    after = snapshot(opt, params)
    assert all(torch.equal(a, b) for a, b in zip(before[0] + before[1], after[0] + after[1]))
