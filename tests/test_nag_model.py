"""The NAG model: init, constraints, optimizer groups, FLOP-matched horizon, telemetry, checkpoints."""

import json
import math
import os

import pytest
import torch

from nanochat.gpt import GPT, GPTConfig
from nanochat.common import UserError
from nanochat import checkpoint_manager as ckpt
from nag.model import NAGGPT, NAGConfig
from nag import archs
from scripts import base_train
from conftest import TINY_TRAIN

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # models of width 32, trained in this process
CFG = dict(sequence_len=32, vocab_size=128, n_layer=3, n_head=2, n_kv_head=2, n_embd=32)


def tiny_nag(seed=0, **nag):
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = NAGGPT(GPTConfig(**CFG), nag=NAGConfig(**nag))
    model.to_empty(device="cpu")
    model.init_weights()
    return model


def meta_model(cls, config):
    with torch.device("meta"):
        return cls(config)


def test_gate_params_are_counted_as_matmuls():
    gpt = meta_model(GPT, GPTConfig(**CFG))
    nag = meta_model(NAGGPT, GPTConfig(**CFG))
    matmuls = 2 * 3 * 32 * 32  # 2 branches × 3 blocks × m_down (d=32 → C=32)
    assert nag.estimate_flops() - gpt.estimate_flops() == 6 * matmuls
    # S of the size rules takes the gates whole, as the published code does: m_down's bias, coef (C), β_raw, α too
    assert nag.num_scaling_params() - gpt.num_scaling_params() == matmuls + 2 * 3 * (32 + 32 + 1 + 1)


@pytest.mark.parametrize("arch", ["gpt", "nag", "gpt-recipe"])
def test_a_model_built_on_the_meta_device_draws_no_init(arch, monkeypatch):
    # every model is built on the meta device, then initialised where it lives (init_weights): a draw on meta is
    # wasted, and nn.Embedding's own normal_ there imported torch._dynamo, ~1.5 s of CPU in each process
    def refuse(*args, **kwargs):
        raise AssertionError("an init drawn on the meta device")

    monkeypatch.setattr(torch.nn.init, "normal_", refuse)
    with torch.device("meta"):
        archs.arch_spec(arch).model_class(GPTConfig(**CFG))


def test_init_values():
    model = tiny_nag(alpha_init_power=0.5)
    alphas = [br.alpha.item() for _, br in model.branches()]
    assert alphas == pytest.approx([l**-0.5 for l in range(1, 7)])
    for _, br in model.branches():
        assert br.beta_raw.item() == pytest.approx(0.5413)
        assert torch.nn.functional.softplus(br.beta_raw).item() == pytest.approx(1.0, abs=1e-4)
        assert br.coef.abs().sum() == 0 and br.m_down_bias.abs().sum() == 0
        assert br.m_down_weight.abs().max() <= math.sqrt(3) * 32**-0.5
    assert model.log_gain_encode.item() == 0
    assert model.wte.weight.mean(dim=1).abs().max() < 1e-6
    w = model.lm_head.weight
    assert w.mean(dim=1).abs().max() < 1e-6
    assert torch.allclose(w.square().mean(dim=1), torch.ones(128), atol=1e-5)


def test_alpha_warmup_schedule():
    model = tiny_nag(alpha_warmup_tokens=1000)
    for tokens, want in [(0, 0.0), (250, 0.25), (1000, 1.0), (5000, 1.0)]:
        model.set_tokens_seen(tokens)
        assert model.alpha_warmup.item() == pytest.approx(want)
    off = tiny_nag(alpha_warmup_tokens=0)
    off.set_tokens_seen(0)
    assert off.alpha_warmup.item() == 1.0


def test_loss_at_init_and_training_falls():
    model = tiny_nag(alpha_warmup_tokens=0)
    x = torch.randint(0, 128, (4, 32))
    y = torch.roll(x, -1, 1)
    first = model(x, y).item()
    assert math.isfinite(first) and abs(first - math.log(128)) < 0.1
    opt = model.setup_optimizer()
    for _ in range(15):
        model(x, y).backward()
        opt.step()
        model.after_optimizer_step()
        model.zero_grad(set_to_none=True)
    assert model(x, y).item() < first - 1.0
    # constraints survive the optimizer
    assert model.wte.weight.mean(dim=1).abs().max() < 1e-5
    assert torch.allclose(model.lm_head.weight.square().mean(dim=1), torch.ones(128), atol=1e-4)


def test_optimizer_groups_cover_every_param_once():
    model = tiny_nag()
    opt = model.setup_optimizer(gate_lr=1e-3, temp_gain_lr=5e-3, lr_scale=2.0)
    by_name = {}
    for g in opt.param_groups:
        for p in g["params"]:
            assert id(p) not in by_name
            by_name[id(p)] = g
    names = dict((id(p), n) for n, p in model.named_parameters())
    assert set(by_name) == set(names)
    for pid, g in by_name.items():
        n = names[pid]
        if n.startswith("gates."):
            assert g["kind"] == "adamw" and g["lr"] == pytest.approx(2e-3)
        elif n == "log_gain_encode":
            assert g["lr"] == pytest.approx(1e-2)
        elif n.startswith("blocks."):
            assert g["kind"] == "muon"


def test_telemetry_fields():
    model = tiny_nag(alpha_warmup_tokens=0)
    t = model.gate_telemetry(torch.randint(0, 128, (2, 32)))
    assert t["num_branches"] == 6 and len(t["branches"]) == 6
    assert t["branches"][3]["name"] == "1.mlp"
    assert t["alpha_max"] == pytest.approx(1.0) and t["alpha_min"] == pytest.approx(6**-0.5)
    assert len(t["gain_by_depth_quartile"]) == 4
    assert t["dead_branches"] == 0 and t["dead_relative"] == 0 and t["dead_walkthrough"] == 0
    # with m_down = 0 and bias b, u = σ(b) exactly, and the floor catches u below it
    with torch.no_grad():
        br = model.gates.branch(3)  # block 1's attention
        br.m_down_weight.zero_()
        br.m_down_bias.fill_(-1.0)
        model.gates.branch(2).m_down_weight.zero_()
        model.gates.branch(2).m_down_bias.fill_(-30.0)  # u ≈ 9e-14, below the 1e-6 floor
    t = model.gate_telemetry(torch.randint(0, 128, (2, 32)))
    assert t["branches"][2]["u_mean"] == pytest.approx(torch.sigmoid(torch.tensor(-1.0)).item(), rel=1e-5)
    # β = 1 at init
    assert t["branches"][2]["m_mean"] == pytest.approx(torch.sigmoid(torch.tensor(-1.0)).item(), rel=1e-4)
    assert t["branches"][2]["gain_abs_mean"] == pytest.approx(
        3**-0.5 * torch.sigmoid(torch.tensor(-1.0)).item(), rel=1e-4
    )
    assert t["branches"][1]["floor_frac"] == 1.0 and t["branches"][2]["floor_frac"] == 0.0
    # a branch with α = 0 counts as dead
    with torch.no_grad():
        model.gates.branch(6).alpha.zero_()
    t = model.gate_telemetry(torch.randint(0, 128, (2, 32)))
    assert t["dead_branches"] == 2  # α = 0, and u at the floor
    # the walkthrough's count sees both; the relative one (mean m < 0.1) only the shut modulator, not α = 0
    assert t["dead_walkthrough"] == 2 and t["dead_relative"] == 1
    assert t["branches"][1]["u_min"] == pytest.approx(torch.sigmoid(torch.tensor(-30.0)).item(), rel=1e-4)
    assert t["branches"][1]["beta"] == pytest.approx(0.99998, abs=1e-5)


@pytest.mark.parametrize("arch", ["gpt", "nag"])
def test_checkpoint_round_trip(tmp_path, arch):
    torch.manual_seed(0)
    cls = NAGGPT if arch == "nag" else GPT
    kwargs = {"nag": NAGConfig(mod_floor=0.0, renorm="predicted", directions=8)} if arch == "nag" else {}
    with torch.device("meta"):
        model = cls(GPTConfig(**CFG), **kwargs)
    model.to_empty(device="cpu")
    model.init_weights()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    meta = {"arch": arch, "model_config": model.config.to_dict(), **model.extra_meta()}
    ckpt.save_checkpoint(str(tmp_path), 5, model, meta, {"x": 1})
    loaded, meta2 = archs.load_model(str(tmp_path))
    assert type(loaded) is cls and meta2["arch"] == arch
    if arch == "nag":
        assert loaded.nag == kwargs["nag"]
    x = torch.randint(0, 128, (2, 16))
    assert torch.equal(model(x), loaded(x))
    # loading into the wrong class is a clear error
    other = NAGGPT if arch == "gpt" else GPT
    with torch.device("meta"):
        wrong = other(GPTConfig(**CFG))
    wrong.to_empty(device="cpu")
    with pytest.raises(UserError, match="holds a"):
        ckpt.load_weights(wrong, ckpt.load_model_file(str(tmp_path), 5))


def per_branch_state(state):
    """A NAG state dict as a checkpoint of before the stacks held it: one tensor per branch and kind, under
    gates.{block}.{attn,mlp}_branch.{m_down.weight, m_down.bias, coef, beta_raw, alpha}."""
    old = {k: v for k, v in state.items() if not k.startswith("gates.")}
    for key, stack in state.items():
        if key.startswith("gates."):
            name = key[len("gates.") :].replace("m_down_", "m_down.")
            for k, row in enumerate(stack):
                old[f"gates.{k // 2}.{('attn', 'mlp')[k % 2]}_branch.{name}"] = row.clone()
    return old


def test_gates_are_one_tensor_per_kind():
    model = tiny_nag()
    gates = {n: tuple(p.shape) for n, p in model.named_parameters() if n.startswith("gates.")}
    assert gates == {
        "gates.m_down_weight": (6, 32, 32),
        "gates.m_down_bias": (6, 32),
        "gates.coef": (6, 32),
        "gates.beta_raw": (6, 1),
        "gates.alpha": (6, 1),
    }
    # one draw over the stack takes the numbers that a draw per branch took: a seed gives the weights it gave before
    torch.manual_seed(3)
    stacked = torch.empty(6, 32, 32).uniform_(-1, 1)
    torch.manual_seed(3)
    assert torch.equal(stacked, torch.stack([torch.empty(32, 32).uniform_(-1, 1) for _ in range(6)]))
    # update l reads row l − 1 of every stack, in the forward as in branches()
    for (l, br), fwd in zip(model.branches(), model.gates.unbound()):
        assert br.l == fwd.l == l and torch.equal(br.alpha, fwd.alpha)
        assert torch.equal(br.coef, model.gates.coef[l - 1])
    # the gradient of each stack is one tensor, its row k that of update k + 1
    x = torch.randint(0, 128, (2, 32))
    model(x, torch.roll(x, -1, 1)).backward()
    assert all(p.grad is not None and p.grad.shape == p.shape for p in model.gates.parameters())


def test_a_checkpoint_of_per_branch_gates_loads():
    model = tiny_nag(seed=1)
    old = per_branch_state(model.state_dict())
    assert "gates.2.mlp_branch.m_down.weight" in old and "gates.coef" not in old
    fresh = tiny_nag(seed=2)
    fresh.load_state_dict(old)  # strict: every old key taken, every stack filled
    assert all(torch.equal(v, fresh.state_dict()[k]) for k, v in model.state_dict().items())
    x = torch.randint(0, 128, (2, 16))
    assert torch.equal(model(x), fresh(x))


def test_a_run_of_per_branch_gates_evaluates_but_does_not_resume(run_base, script_error):
    run = TINY_TRAIN + ["--arch", "nag", "--run", "old", "--num-iterations", "4", "--save-every", "2"]
    run_dir = base_train.main(run + ["--eval-every", "100", "--nag-gate-log-every", "0"])
    # step 2 as the code of before the stacks saved it (its meta records the new file size)
    path, saved = ckpt.model_path(run_dir, 2), ckpt.load_model_file(run_dir, 2)
    stacked = dict(saved["model"])
    torch.save({**saved, "model": per_branch_state(stacked)}, path)
    with open(ckpt.meta_path(run_dir, 2)) as f:
        meta = json.load(f)
    meta["file_sizes"][os.path.basename(path)] = os.path.getsize(path)
    with open(ckpt.meta_path(run_dir, 2), "w") as f:
        json.dump(meta, f)
    model, _ = archs.load_model(run_dir, 2)  # evaluation, sampling, export
    assert all(torch.equal(v, stacked[k]) for k, v in model.state_dict().items())
    # its optimizer state is keyed to the 5 tensors per sub-layer: a resume is one line
    err = script_error(base_train.main, *run, "--eval-every", "100", "--nag-gate-log-every", "0", "--resume", "2")
    assert "cannot resume" in err and "older layout (gates.0.attn_branch.alpha, ...)" in err, err


def test_nonfinite_origin_reads_the_row_of_a_stacked_gradient():
    model = tiny_nag()
    x = torch.randint(0, 128, (2, 32))
    model(x, torch.roll(x, -1, 1)).backward()
    assert model.nonfinite_origin(x) is None
    model.gates.coef.grad[3, 5] = float("nan")  # block 1's MLP, update 4
    model.gates.alpha.grad[1, 0] = float("inf")  # an earlier branch: the deepest is named
    assert model.nonfinite_origin(x).startswith("branch 1.mlp (update 4): deepest non-finite gate gradient")


def test_fused_and_reference_train_alike():
    """A few optimizer steps with the Triton kernel (interpreter mode on CPU) track the reference."""
    pytest.importorskip("triton")
    losses = {}
    for impl in ("reference", "fused"):
        torch.manual_seed(0)
        with torch.device("meta"):
            model = NAGGPT(GPTConfig(**dict(CFG, n_layer=2)), nag=NAGConfig(alpha_warmup_tokens=0), impl=impl)
        model.to_empty(device="cpu")
        model.init_weights()
        opt = model.setup_optimizer()
        x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
        y = torch.roll(x, -1, 1)
        losses[impl] = []
        for _ in range(4):
            loss = model(x, y)
            loss.backward()
            opt.step()
            model.after_optimizer_step()
            model.zero_grad(set_to_none=True)
            losses[impl].append(loss.item())
    assert losses["reference"][-1] < losses["reference"][0]
    assert losses["fused"] == pytest.approx(losses["reference"], abs=1e-4)


@pytest.mark.parametrize("arch", ["gpt", "nag"])
def test_packed_rows_give_each_sequence_its_own_logits(arch):
    # two sequences sharing a 20-token prefix, packed as prefix + rest of A + rest of B, against each
    # sequence alone; window pattern "SL" makes layer 0 a 16-token sliding window, counted in positions
    torch.manual_seed(1)
    cfg = dict(CFG, window_pattern="SL")
    with torch.device("meta"):
        model = NAGGPT(GPTConfig(**cfg), nag=NAGConfig()) if arch == "nag" else GPT(GPTConfig(**cfg))
    model.to_empty(device="cpu")
    model.init_weights()
    with torch.no_grad():  # zero-initialised projections: perturb so that every layer mixes tokens
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    prefix = torch.randint(0, 128, (20,))
    a = torch.cat([prefix, torch.randint(0, 128, (9,))])
    b = torch.cat([prefix, torch.randint(0, 128, (5,))])
    row = torch.cat([a, b[20:]])[None]
    positions = torch.tensor(list(range(29)) + list(range(20, 25)))[None]
    branch = [0] * 20 + [1] * 9 + [2] * 5
    allowed = torch.tensor([[k <= q and (branch[k] in (0, branch[q])) for k in range(34)] for q in range(34)])[None]
    packed = model(row, positions=positions, allowed=allowed)
    alone_a, alone_b = model(a[None])[0], model(b[None])[0]
    assert torch.allclose(packed[0, :29], alone_a, atol=1e-5)
    assert torch.allclose(packed[0, 29:], alone_b[20:], atol=1e-5)
    # without the positions and mask, B's tokens would see A's: the packing is what keeps them apart
    assert not torch.allclose(model(row)[0, 29:], alone_b[20:], atol=1e-3)
    # logits at chosen (row, col) pairs only
    at = (torch.tensor([0, 0, 0]), torch.tensor([3, 28, 33]))
    picked = model(row, positions=positions, allowed=allowed, logits_at=at)
    assert picked.shape == (3, 128) and torch.allclose(picked, packed[at], atol=1e-6)
    assert torch.allclose(model(a[None], logits_at=(torch.tensor([0]), torch.tensor([7]))), alone_a[7:8], atol=1e-6)
