"""MuonAdamW on one rank: missing gradients, compiled vs eager update, old checkpoints.

Parameters without a gradient (a MoD sub-layer that ran no token) miss the step alone; the compiled
update equals the eager one; a checkpoint from before sharding loads. Sharding over ranks:
tests/test_optim_sharded.py."""

import contextlib
import copy

import pytest
import torch

from nanochat import optim
from nanochat.optim import MuonAdamW, muon_update

MUON = dict(kind="muon", lr=0.02, momentum=0.95, weight_decay=0.1)
ADAMW = dict(kind="adamw", lr=0.01, betas=(0.8, 0.95), eps=1e-10, weight_decay=0.1)


def matrices(n, shape=(8, 6), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).requires_grad_() for _ in range(n)]


def grads(n, shape, step):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(shape, generator=g) for _ in range(n)]


@pytest.mark.cpu_kind
@pytest.mark.parametrize("shape", [(8, 6), (6, 8)], ids=["tall", "wide"])
@pytest.mark.parametrize("skipped, first_skip", [(0, 0), (2, 1)], ids=["state-key-from-start", "later"])
def test_muon_skips_only_the_matrix_without_a_gradient(shape, skipped, first_skip):
    # skipped: the matrix without a gradient from step first_skip on (index 0 keys the stacked state)
    ps = matrices(4, shape)
    opt = MuonAdamW([dict(MUON, params=ps)])
    for step in range(first_skip):  # steps with every gradient
        for p, g in zip(ps, grads(4, shape, step)):
            p.grad = g
        opt.step()
    state = opt.state[ps[0]]
    frozen_p = ps[skipped].detach().clone()
    if first_skip:
        frozen_rows = state["momentum_buffer"][skipped].clone(), state["variance_buffer"][skipped].clone()
    # the reference: a group without the skipped matrix, starting from the others' weights and state rows
    others = [i for i in range(4) if i != skipped]
    ref_p = torch.stack([ps[i].detach() for i in others])
    ref_m = state["momentum_buffer"][others].clone() if first_skip else torch.zeros(3, *shape)
    ref_v = state["variance_buffer"][others].clone() if first_skip else None
    if ref_v is None:
        ref_v = torch.zeros((3, shape[0], 1) if shape[0] >= shape[1] else (3, 1, shape[1]))
    for step in range(first_skip, first_skip + 3):
        gs = grads(4, shape, step)
        for i, (p, g) in enumerate(zip(ps, gs)):
            p.grad = None if i == skipped else g
        opt.step()
        muon_update(
            ref_p,
            torch.stack([gs[i] for i in others]),
            ref_m,
            ref_v,
            MUON["lr"],
            MUON["momentum"],
            MUON["weight_decay"],
        )
    for j, i in enumerate(others):
        assert torch.equal(ps[i].detach(), ref_p[j]), i
    state = opt.state[ps[0]]
    assert torch.equal(state["momentum_buffer"][others], ref_m) and torch.equal(state["variance_buffer"][others], ref_v)
    assert torch.equal(ps[skipped].detach(), frozen_p)
    if first_skip:
        assert torch.equal(state["momentum_buffer"][skipped], frozen_rows[0])
        assert torch.equal(state["variance_buffer"][skipped], frozen_rows[1])
    else:  # never had a gradient: its rows are still the initial zeros
        assert not state["momentum_buffer"][skipped].any() and not state["variance_buffer"][skipped].any()


def test_muon_with_every_gradient_is_one_stacked_update():
    # the previous behaviour, unchanged: the whole group as one stack
    shape = (8, 6)
    ps = matrices(3, shape)
    opt = MuonAdamW([dict(MUON, params=ps)])
    ref_p = torch.stack([p.detach() for p in ps])
    ref_m, ref_v = torch.zeros(3, *shape), torch.zeros(3, 8, 1)
    for step in range(3):
        gs = grads(3, shape, step)
        for p, g in zip(ps, gs):
            p.grad = g
        opt.step()
        muon_update(ref_p, torch.stack(gs), ref_m, ref_v, MUON["lr"], MUON["momentum"], MUON["weight_decay"])
    assert all(torch.equal(p.detach(), r) for p, r in zip(ps, ref_p))
    assert torch.equal(opt.state[ps[0]]["momentum_buffer"], ref_m) and torch.equal(
        opt.state[ps[0]]["variance_buffer"], ref_v
    )


@pytest.mark.cpu_kind
def test_adamw_gate_that_misses_a_step_keeps_its_own_step_count():
    # three gates in one group; gate 1 has no gradient at step 2 (its sub-layer ran no token)
    ps = matrices(3, (5,))
    alone = [t.detach().clone().requires_grad_() for t in ps]
    opt = MuonAdamW([dict(ADAMW, params=ps)])
    solo = [MuonAdamW([dict(ADAMW, params=[a])]) for a in alone]  # each gate with its own optimizer
    torch_ref = ps[1].detach().clone().requires_grad_()
    torch_opt = torch.optim.AdamW(
        [torch_ref], lr=ADAMW["lr"], betas=ADAMW["betas"], eps=ADAMW["eps"], weight_decay=ADAMW["weight_decay"]
    )
    for step in range(4):
        gs = grads(3, (5,), step)
        for i, (p, a, o, g) in enumerate(zip(ps, alone, solo, gs)):
            if i == 1 and step == 1:
                p.grad = None
                continue
            p.grad, a.grad = g, g.clone()
            o.step()
        opt.step()
        if step != 1:
            torch_ref.grad = gs[1].clone()
            torch_opt.step()
    assert [opt.state[p]["step"] for p in ps] == [4, 3, 4]
    for p, a in zip(ps, alone):
        assert torch.equal(p.detach(), a.detach())
    assert torch.allclose(ps[1].detach(), torch_ref.detach(), rtol=1e-6, atol=1e-7)  # bias correction at its own step


def test_compiled_update_equals_eager(monkeypatch):
    # compile=True on the CPU (inductor, one graph each for the Muon stack and the large AdamW tensor, its row
    # constraint inside; the small gate stays eager): to float noise the eager update, and a new LR, momentum, decay
    # or step count is no new graph.
    # One Polar Express iteration instead of five: the same graph structure, compiled in ~20 s instead of ~35 s (cold)
    from torch._dynamo.utils import counters

    monkeypatch.setattr(optim, "POLAR_EXPRESS_COEFFS", optim.POLAR_EXPRESS_COEFFS[:1])

    def make(compile):
        g = torch.Generator().manual_seed(7)
        ms, big, gate = (
            matrices(3),
            torch.randn(256, 256, generator=g).requires_grad_(),
            torch.randn(5, generator=g).requires_grad_(),
        )
        big_group = dict(ADAMW, params=[big], constrain="centred_unit_rms")
        opt = MuonAdamW([dict(MUON, params=ms), big_group, dict(ADAMW, params=[gate])], compile=compile)
        return ms + [big, gate], opt

    (eager, opt_e), (comp, opt_c) = make(False), make(True)
    graphs = counters["stats"]["unique_graphs"]
    for step in range(3):
        gs = grads(3, (8, 6), step) + [torch.randn(256, 256), torch.randn(5)]
        for ps, opt in ((eager, opt_e), (comp, opt_c)):
            for p, g in zip(ps, gs):
                p.grad = g.clone()
            for group in opt.param_groups:
                group["lr"] = group["initial_lr"] * (1 - 0.2 * step)
                if group["kind"] == "muon":
                    group["momentum"], group["weight_decay"] = 0.9 + 0.02 * step, 0.1 / (1 + step)
            opt.step()
    assert counters["stats"]["unique_graphs"] - graphs == 2
    for e, c in zip(eager, comp):
        assert torch.allclose(e, c, rtol=1e-5, atol=1e-6), (e - c).abs().max()
    assert torch.equal(eager[-1], comp[-1])  # the gate took the eager path in both


def test_checkpoint_from_before_sharding_loads_and_steps_on_identically():
    # today's format: torch's state dict, no "shard" record; the loaded optimizer continues bit for bit
    ps = matrices(3) + [t.requires_grad_() for t in matrices(2, (5,), seed=1)]
    opt = MuonAdamW([dict(MUON, params=ps[:3]), dict(ADAMW, params=ps[3:])])
    for step in range(2):
        for p, g in zip(ps, grads(3, (8, 6), step) + grads(2, (5,), step)):
            p.grad = g
        opt.step()
    legacy = {k: v for k, v in opt.state_dict().items() if k != "shard"}
    twins = [p.detach().clone().requires_grad_() for p in ps]
    opt2 = MuonAdamW([dict(MUON, params=twins[:3]), dict(ADAMW, params=twins[3:])])
    opt2.load_state_dict(copy.deepcopy(legacy))
    for step in range(2, 4):
        for p, t, g in zip(ps, twins, grads(3, (8, 6), step) + grads(2, (5,), step)):
            p.grad, t.grad = g, g.clone()
        opt.step()
        opt2.step()
    assert all(torch.equal(p.detach(), t.detach()) for p, t in zip(ps, twins))


def test_a_gated_adamw_update_dispatches_as_many_launches_for_30_tensors_as_for_3():
    # one foreach op per list, and the gate's select over every tensor at once: a launch per tensor would add up over
    # hundreds of small tensors
    from scripts.bench.optim import StepLaunches

    def launches(n):
        ps = matrices(n, (5,))
        opt = MuonAdamW([dict(ADAMW, params=ps)])
        for counted in (False, True):
            for p in ps:
                p.grad = torch.ones_like(p)
            with StepLaunches() if counted else contextlib.nullcontext() as count:
                opt.step(torch.tensor(True))
        return count.total

    assert launches(3) == launches(30)


@pytest.mark.parametrize("arch", ["gpt", "nag"])
def test_an_optimizer_step_launches_as_many_kernels_at_depth_64_as_at_8(arch):
    # base_train's step (gated, then after_optimizer_step), eager on the CPU: an op per layer would show as more
    # launches at depth 64. The lists of the foreach ops grow with the Muon stacks, GPT's too; NAG's gates and its
    # other AdamW tensors add the same number at any depth (its gates stacked: five tensors, not five per sub-layer)
    from scripts.bench.optim import LAUNCH_DEPTHS, step_launches

    shallow, deep = (step_launches(arch, d) for d in LAUNCH_DEPTHS)
    assert shallow["launches"] == deep["launches"]
    if arch == "nag":
        gpt = [step_launches("gpt", d)["listed"] for d in LAUNCH_DEPTHS]
        assert shallow["listed"] - gpt[0] == deep["listed"] - gpt[1]


def centred(w):  # a model's constraint as it was applied after the optimizer's step
    w.sub_(w.mean(dim=1, keepdim=True))


def centred_unit_rms(w):
    centred(w)
    w.mul_(torch.rsqrt(w.square().mean(dim=1, keepdim=True).clamp_min(1e-30)))


@pytest.mark.parametrize("rule", [centred, centred_unit_rms], ids=lambda f: f.__name__)
def test_a_group_row_constraint_is_the_step_then_the_constraint_bit_for_bit(rule):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(6, 5, generator=g)
    inside, after = w.clone().requires_grad_(), w.clone().requires_grad_()
    opt_inside = MuonAdamW([dict(ADAMW, params=[inside], constrain=rule.__name__)])
    opt_after = MuonAdamW([dict(ADAMW, params=[after])])
    for step in range(3):
        grad = torch.randn(6, 5, generator=g)
        inside.grad, after.grad = grad, grad.clone()
        opt_inside.step(torch.tensor(True))
        opt_after.step(torch.tensor(True))
        with torch.no_grad():
            rule(after)
        assert torch.equal(inside, after), step
    # a vetoed step moves nothing, the constraint included
    before = inside.detach().clone()
    inside.grad = torch.full_like(inside, float("nan"))
    opt_inside.step(torch.tensor(False))
    assert torch.equal(inside, before)


def test_only_an_adamw_group_takes_a_row_constraint_and_a_known_one():
    with pytest.raises(ValueError, match="only an AdamW group"):
        MuonAdamW([dict(MUON, params=matrices(2), constrain="centred")])
    with pytest.raises(ValueError, match="'sideways'"):
        MuonAdamW([dict(ADAMW, params=matrices(2), constrain="sideways")])


def test_nag_keeps_its_row_constraints_through_the_optimizer_alone():
    # the optimizer imposes them in its update: after_optimizer_step has nothing left to do
    from nag.model import NAGGPT
    from nanochat.gpt import GPTConfig

    torch.manual_seed(0)
    model = NAGGPT.initialised(GPTConfig(sequence_len=8, vocab_size=32, n_layer=1, n_head=1, n_kv_head=1, n_embd=8))
    opt = model.setup_optimizer()
    assert {g["name"]: g.get("constrain") for g in opt.param_groups if g["kind"] == "adamw"} == {
        "wte": "centred",
        "lm_head": "centred_unit_rms",
        "nag_gates": None,
        "nag_temp_gain": None,
    }
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    assert model.wte.weight.mean(dim=1).abs().max() < 1e-6
    assert torch.allclose(model.lm_head.weight.square().mean(dim=1), torch.ones(32), atol=1e-5)
