"""The rival depth arms (nag/rivals.py, docs/design.md §11), from formula to export.

Each arm against a plain-PyTorch restatement of its formula; undone, the GPT baseline bit for bit where the math
allows; FLOPs and S; checkpoints; KV-cache decoding; the residual capture of analysis/capture.py; the Hugging Face
export's logits and generation."""

import math

import pytest
import torch

from conftest import random_model
from analysis.capture import CaptureConfig, capture
from nanochat.engine import KVCache, generate
from nanochat import checkpoint_manager as ckpt
from nanochat.common import UserError
from nanochat.gpt import GPT, GPTConfig, CausalSelfAttention, SOFTCAP
from nag import archs
from nag.rivals import LAYERROPE_INITS, SITES, LayerRoPEGPT, LNSGPT, PeriGPT

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# GQA and an S layer (a window of 16 positions) before the L one
CFG = GPTConfig(sequence_len=32, vocab_size=64, n_layer=4, n_head=4, n_kv_head=2, n_embd=32, window_pattern="SL")
ARMS = {"gpt-lns": LNSGPT, "gpt-peri": PeriGPT, "gpt-layerrope": LayerRoPEGPT}


def rms(x):
    """The parameter-free RMSNorm restated (F.rms_norm's default eps: the dtype's machine epsilon)."""
    return x / torch.sqrt(x.square().mean(-1, keepdim=True) + torch.finfo(x.dtype).eps)


def own_params(model):
    baseline = dict(GPT.initialised(model.config).named_parameters())
    return {n: p for n, p in model.named_parameters() if n not in baseline}


def twins(cls, config=CFG, **kwargs):
    """(gpt, arm): the same random matrices (every one awake, conftest.random_model), the arm's own at their init."""
    gpt = random_model(GPT, config, config.vocab_size)
    arm = cls.initialised(config, **kwargs).eval()
    missing, unexpected = arm.load_state_dict(gpt.state_dict(), strict=False)
    assert not unexpected and set(missing) == set(arm.state_dict()) - set(gpt.state_dict())
    return gpt, arm


@torch.no_grad()
def shake(model, seed=3):
    """The arm's own parameters moved off their init (gains and depth scalars), as training would."""
    g = torch.Generator().manual_seed(seed)
    for p in own_params(model).values():
        p.add_(0.3 * torch.randn(p.shape, generator=g))
    return model


def tokens(B=2, T=16, seed=0):
    return torch.randint(0, CFG.vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))


def layerrope_gain(gamma, depth, base, l):
    """γ_l by complex arithmetic in fp64: (γ_2j + iγ_2j+1)·exp(r(l) + iθ(l, j))."""
    a, b, a_rot, b_rot = depth.double().tolist()
    d = gamma.numel()
    z = torch.view_as_complex(gamma.double().reshape(d // 2, 2).contiguous())
    j = torch.arange(d // 2, dtype=torch.float64)
    theta = math.exp(a_rot + b_rot * math.log(l + 1)) * float(base) ** (-2 * j / d)
    r = torch.full_like(theta, a + b * math.log(l + 1))
    return torch.view_as_real(z * torch.exp(torch.complex(r, theta))).flatten()


def arm_formula(model):
    """Per layer l (0-based): (read attn, read mlp, write attn, write mlp), plain functions of the arm's parameters."""
    L, same = model.config.n_layer, (lambda y: y)
    if isinstance(model, LNSGPT):
        return [((lambda h, l=l: h / math.sqrt(l + 1)),) * 2 + (same, same) for l in range(L)]
    if isinstance(model, PeriGPT):
        return [
            (same, same, lambda y, b=b: rms(y) * b.attn.out_gain, lambda y, b=b: rms(y) * b.mlp.out_gain)
            for b in model.blocks
        ]
    lr = model.layerrope
    gains = [[layerrope_gain(lr.gamma[s], lr.depth[s], lr.base, l).float() for s in SITES] for l in range(L)]
    return [tuple((lambda t, g=g: t * g) for g in gs) for gs in gains]


def by_hand(model, idx):
    """The residual states x_0..x_2L and the logits, each branch's reads and writes restated (arm_formula); the
    branches themselves are the baseline's (its attention module's math, the ReLU² MLP by hand)."""
    cos_sin = model.rotary(idx.size(1))
    x = rms(model.wte(idx))
    states = [x]
    for block, (ra, rm, wa, wm) in zip(model.blocks, arm_formula(model)):
        x = x + wa(CausalSelfAttention.forward(block.attn, ra(rms(x)), cos_sin, None))
        states.append(x)
        h = rm(rms(x))
        x = x + wm(torch.relu(h @ block.mlp.c_fc.weight.T).square() @ block.mlp.c_proj.weight.T)
        states.append(x)
    logits = rms(x) @ model.lm_head.weight.T
    return states, SOFTCAP * torch.tanh(logits / SOFTCAP)


# ---------------------------------------------------------------------------
# each arm is its formula


@torch.no_grad()
def test_lns_scales_each_pre_norm_by_one_over_root_l():
    _, model = twins(LNSGPT)
    L = CFG.n_layer
    # 1/√L (two roundings) against L^-½ (pow's one): up to a few 2^-53 apart, equal only where √L is exact
    assert model.lns_scales[0] == 1.0 and model.lns_scales[-1] == pytest.approx(L**-0.5, rel=2**-50)
    seen = {}
    for i in (0, L - 1):
        blk = model.blocks[i]
        blk.register_forward_pre_hook(lambda m, a, i=i: seen.__setitem__(("x", i), a[0]))
        blk.attn.register_forward_pre_hook(lambda m, a, i=i: seen.__setitem__(("attn", i), a[0]))
        blk.attn.register_forward_hook(lambda m, a, out, i=i: seen.__setitem__(("a", i), out))
        blk.mlp.register_forward_pre_hook(lambda m, a, i=i: seen.__setitem__(("mlp", i), a[0]))
    idx = tokens()
    logits = model(idx)
    for i, l in ((0, 1), (L - 1, L)):  # the 1-based index l of the first and the last block
        x = seen[("x", i)]
        assert torch.allclose(seen[("attn", i)], rms(x) / math.sqrt(l), atol=1e-6)
        assert torch.allclose(seen[("mlp", i)], rms(x + seen[("a", i)]) / math.sqrt(l), atol=1e-6)
    assert not torch.allclose(seen[("attn", L - 1)], rms(seen[("x", L - 1)]), atol=1e-2)  # the last block is scaled
    # under QK-norm the scale s reaches the values only, and ReLU² is 2-homogeneous: outputs × s and × s² (§11)
    h, blk, sc = rms(seen[("x", L - 1)]), model.blocks[L - 1], L**-0.5
    cos_sin = model.rotary(idx.size(1))
    assert torch.allclose(blk.attn(h * sc, cos_sin, None), sc * blk.attn(h, cos_sin, None), atol=1e-5)
    assert torch.allclose(blk.mlp(h * sc), sc**2 * blk.mlp(h), atol=1e-6)
    assert torch.allclose(logits, by_hand(model, idx)[1], atol=1e-5)


@torch.no_grad()
def test_peri_normalises_each_branch_output_with_its_gain():
    model = shake(twins(PeriGPT)[1])
    block = model.blocks[1]
    h = rms(torch.randn(2, 16, CFG.n_embd, generator=torch.Generator().manual_seed(5)))
    cos_sin = model.rotary(16)
    raw = CausalSelfAttention.forward(block.attn, h, cos_sin, None)
    out = block.attn(h, cos_sin, None)
    assert torch.allclose(out, rms(raw) * block.attn.out_gain, atol=1e-6)
    assert torch.allclose((out / block.attn.out_gain).square().mean(-1), torch.ones(2, 16), atol=1e-4)  # RMS 1 before g
    raw = torch.relu(h @ block.mlp.c_fc.weight.T).square() @ block.mlp.c_proj.weight.T
    assert torch.allclose(block.mlp(h), rms(raw) * block.mlp.out_gain, atol=1e-6)
    idx = tokens()
    assert torch.allclose(model(idx), by_hand(model, idx)[1], atol=1e-5)


@pytest.mark.parametrize("init", list(LAYERROPE_INITS))
@torch.no_grad()
def test_layerrope_gains_are_the_complex_formula(init):
    cfg = LAYERROPE_INITS[init]
    config = GPTConfig(sequence_len=16, vocab_size=64, n_layer=8, n_head=2, n_kv_head=2, n_embd=32)
    model = LayerRoPEGPT.initialised(config, layerrope=cfg)
    lr = model.layerrope
    assert float(lr.base) == cfg.base
    gains = lr.gains(8)
    ones = torch.ones(32)
    for site in SITES:
        assert torch.equal(lr.gamma[site], ones)
        assert lr.depth[site].tolist() == [cfg.alpha, cfg.beta, cfg.alpha_rot, cfg.beta_rot]
        for l in (0, 1, 7):
            want = layerrope_gain(ones, lr.depth[site], cfg.base, l)
            assert torch.allclose(gains[site][l].double(), want, atol=1e-6), (site, l)
            pair_norm = gains[site][l].view(16, 2).norm(dim=1)  # |γ_l| per pair: √2·exp(r(l))
            assert torch.allclose(pair_norm, torch.full((16,), math.sqrt(2) * (l + 1) ** cfg.beta), atol=1e-6)
    g0 = gains["attn_in"][0]
    # θ(0, j) = b^(−2j/d) ≠ 0: the first block's gain is turned already (its first pair by 1 rad)
    assert torch.allclose(g0[:2], torch.tensor([math.cos(1) - math.sin(1), math.sin(1) + math.cos(1)]), atol=1e-6)
    assert not torch.allclose(g0, ones, atol=0.1)
    if init == "ladder":  # the read gain starts at LNS's 1/√(l+1) in magnitude
        assert torch.allclose(gains["mlp_in"][7].view(16, 2).norm(dim=1) / math.sqrt(2), torch.full((16,), 8**-0.5))
    else:  # no depth slope: every block the same gain
        assert torch.allclose(gains["attn_out"][7], gains["attn_out"][0], atol=1e-6)
    shake(model)  # any γ and scalars: still the formula
    gains = lr.gains(8)
    for site in SITES:
        for l in (0, 1, 7):
            want = layerrope_gain(lr.gamma[site], lr.depth[site], cfg.base, l)
            assert torch.allclose(gains[site][l].double(), want, atol=1e-5), (site, l)


@torch.no_grad()
def test_layerrope_reads_and_writes_its_gains():
    gpt, model = twins(LayerRoPEGPT)
    shake(model)
    idx = tokens()
    logits = by_hand(model, idx)[1]
    assert torch.allclose(model(idx), logits, atol=1e-5)
    assert not torch.allclose(gpt(idx), logits, atol=1e-3)


# ---------------------------------------------------------------------------
# undone: the baseline


@pytest.mark.cpu_kind
@pytest.mark.parametrize("arch", list(ARMS))
@torch.no_grad()
def test_at_init_every_arm_is_gpt_bit_for_bit(arch):
    """The same init draws as gpt, and every branch writes 0 (c_proj starts at 0; Peri-LN's N(0) = 0)."""
    idx = tokens()
    torch.manual_seed(0)
    gpt = GPT.initialised(CFG)
    torch.manual_seed(0)
    arm = ARMS[arch].initialised(CFG)
    gpt_sd = gpt.state_dict()
    assert all(torch.equal(t, gpt_sd[k]) for k, t in arm.state_dict().items() if k in gpt_sd)
    assert torch.equal(arm(idx), gpt(idx))


@pytest.mark.cpu_kind
@torch.no_grad()
def test_undone_arms_are_gpt_bit_for_bit_where_the_math_allows():
    idx = tokens()
    gpt, lns = twins(LNSGPT)
    want = gpt(idx)
    assert not torch.equal(lns(idx), want)
    lns.lns_scales = [1.0] * CFG.n_layer  # LNS off: × 1.0 is exact
    assert torch.equal(lns(idx), want)
    _, lrope = twins(LayerRoPEGPT)
    assert not torch.equal(lrope(idx), want)
    for s in SITES:  # r = α + β·log(l+1) = 0 and θ = exp(−∞) = 0: cos 1, sin 0, γ_l = γ = 1 exactly
        lrope.layerrope.depth[s].copy_(torch.tensor([0.0, 0.0, -math.inf, 0.0]))
    assert all(torch.equal(g, torch.ones_like(g)) for g in lrope.layerrope.gains(CFG.n_layer).values())
    assert torch.equal(lrope(idx), want)
    # Peri-LN's output norm has no value that undoes it: with unit gains it is still N(F), not F
    _, peri = twins(PeriGPT)
    assert not torch.allclose(peri(idx), want, atol=1e-3)


# ---------------------------------------------------------------------------
# accounting, optimizer, flags


@pytest.mark.parametrize("arch", list(ARMS))
def test_flops_scaling_params_and_optimizer_groups(arch):
    config = GPTConfig(sequence_len=64, vocab_size=64, n_layer=3, n_head=2, n_kv_head=2, n_embd=32, window_pattern="SL")
    gpt, arm = GPT.initialised(config), ARMS[arch].initialised(config)
    # the arms' work is O(d) per site and token, counted as the baseline counts its norms: not at all
    assert arm.estimate_flops() == gpt.estimate_flops() and arm.num_scaling_params() == gpt.num_scaling_params()
    d, L = config.n_embd, config.n_layer
    added = {"gpt-lns": 0, "gpt-peri": 2 * L * d, "gpt-layerrope": 4 * d + 4 * 4}[arch]
    extra = sum(p.numel() for p in arm.parameters()) - sum(p.numel() for p in gpt.parameters())
    assert extra == added and sum(p.numel() for p in own_params(arm).values()) == added
    groups = arm.optimizer_groups(0.3, 0.004, 0.02, 0.2, 0.5, gain_lr=0.01)
    by_name = {g["name"]: g for g in groups}
    gpt_groups = {g["name"]: g for g in gpt.optimizer_groups(0.3, 0.004, 0.02, 0.2, 0.5)}
    for name, g in gpt_groups.items():  # the baseline's groups as they were
        assert len(by_name[name]["params"]) == len(g["params"]) and by_name[name]["lr"] == g["lr"]
    if added:
        g = by_name["rival_gains"]
        assert g["kind"] == "adamw" and g["weight_decay"] == 0.0 and g["lr"] == 0.01 * 0.5
        assert {id(p) for p in g["params"]} == {id(p) for p in own_params(arm).values()}
    else:
        assert set(by_name) == set(gpt_groups)
    arm.setup_optimizer(gain_lr=0.01)  # every parameter in exactly one group


def test_flags_build_each_arm():
    from scripts import base_train
    from conftest import TINY_TRAIN

    for arch, cls in ARMS.items():
        flags = TINY_TRAIN + [
            "--arch",
            arch,
            "--num-iterations",
            "2",
            "--rival-gain-lr",
            "0.03",
            "--layerrope-init",
            "depth",
        ]
        args = base_train.parse_args(flags)
        plan = archs.plan_for(args, 512, 1)
        assert type(plan.model) is cls
        if cls is LayerRoPEGPT:
            assert plan.model.layerrope_config == LAYERROPE_INITS["depth"]
        names = {g["name"]: g for g in plan.model.optimizer_groups(0.3, 0.004, 0.02, 0.2, 1.0, **plan.optimizer_kwargs)}
        assert (names["rival_gains"]["lr"] == 0.03) if cls is not LNSGPT else ("rival_gains" not in names)
        with pytest.raises(UserError, match="no Mixture-of-Depths"):
            spec = archs.arch_spec(arch)
            mod_args = base_train.parse_args(flags + ["--mod-rate", "0.2"])
            archs.arch_for_args(mod_args)
            spec.init_kwargs(mod_args)


@pytest.mark.parametrize(
    "arch, ignored",
    [
        ("gpt-lns", ["--rival-gain-lr", "--layerrope-init"]),
        ("gpt-peri", ["--layerrope-init"]),
        ("gpt-layerrope", []),
        ("gpt", ["--rival-gain-lr", "--layerrope-init"]),
    ],
)
def test_a_rival_flag_belongs_to_the_arms_that_read_it(arch, ignored):
    """LNS has no gains and only LayerRoPE has an init to pick: a flag an arm ignores gets the note every ignored
    flag gets, and is no setting of its run (base_train's resume never compares it)."""
    from scripts import base_train

    args = base_train.parse_args(["--arch", arch, "--rival-gain-lr", "0.5", "--layerrope-init", "depth"])
    notes = archs.ignored_flags(args, base_train.build_parser().parse_args([]))
    given = [f for note in notes for f in note.split(" appl")[0].removeprefix("note: ").split(", ")]
    assert given == ignored, notes
    rival = {"rival_gain_lr", "layerrope_init"}
    assert rival & set(archs.unread_flags(args)) == {f[2:].replace("-", "_") for f in ignored}


def test_an_ignored_rival_flag_never_blocks_a_resume(run_base, capsys):
    """It once did: "cannot reuse the finished run ... (--rival-gain-lr 0.5 → 0.6)" on a gpt-lns run."""
    from conftest import TINY_TRAIN
    from scripts import base_train

    flags = TINY_TRAIN + ["--arch", "gpt-lns", "--run", "lns", "--num-iterations", "1", "--eval-every", "-1"]
    run_dir = base_train.main(flags + ["--rival-gain-lr", "0.5"])
    assert (
        "note: --rival-gain-lr applies only with a rival arm with learned gains (gpt-peri, gpt-layerrope); "
        "this gpt-lns run ignores it" in capsys.readouterr().out
    )
    assert base_train.main(flags + ["--resume", "latest", "--rival-gain-lr", "0.6"]) == run_dir
    assert "already finished its 1 steps; nothing to do" in capsys.readouterr().out


# ---------------------------------------------------------------------------
# checkpoints, the KV cache, the capture


@pytest.mark.parametrize("arch", list(ARMS))
@torch.no_grad()
def test_checkpoint_round_trip(arch, tmp_path):
    kwargs = {"layerrope": LAYERROPE_INITS["depth"]} if arch == "gpt-layerrope" else {}
    model = shake(twins(ARMS[arch], **kwargs)[1])
    meta = {
        "arch": model.arch,
        "model_config": model.config.to_dict(),
        **model.extra_meta(),
        "step": 3,
        "world_size": 1,
    }
    run_dir = str(tmp_path / "run")
    ckpt.save_checkpoint(run_dir, 3, model, meta, {"optimizer": None})
    loaded, got_meta = archs.load_model(run_dir)
    assert type(loaded) is type(model) and got_meta["arch"] == arch
    if arch == "gpt-layerrope":
        assert loaded.layerrope_config == LAYERROPE_INITS["depth"] and float(loaded.layerrope.base) == 1e4
    sd = loaded.state_dict()
    assert sd.keys() == model.state_dict().keys() and all(torch.equal(sd[k], t) for k, t in model.state_dict().items())
    idx = tokens()
    assert torch.equal(loaded(idx), model(idx))


@pytest.mark.parametrize("arch", list(ARMS))
@torch.no_grad()
def test_kv_cache_decoding_equals_the_full_forward(arch):
    model = shake(twins(ARMS[arch])[1])
    ids = tokens(B=1, T=CFG.sequence_len, seed=7)
    full = model(ids)
    cache = KVCache.for_model(model)
    steps = [model(ids[:, :5], cache=cache)]  # a prefill, then one position at a time, past the S layer's window
    steps += [model(ids[:, t : t + 1], cache=cache) for t in range(5, CFG.sequence_len)]
    assert torch.allclose(torch.cat(steps, dim=1), full, atol=1e-5)
    prompt = ids[0, :4].tolist()
    with_cache = list(generate(model, prompt, 40, temperature=0))
    assert len(with_cache) == CFG.sequence_len - 4 + 1
    assert with_cache == list(generate(model, prompt, 40, temperature=0, use_cache=False))


@pytest.mark.parametrize("arch", list(ARMS))
@torch.no_grad()
def test_capture_sees_the_arms_residual_states(arch):
    model = shake(twins(ARMS[arch])[1])
    gen = torch.Generator().manual_seed(1)
    data = []
    for _ in range(2):
        idx = torch.randint(1, CFG.vocab_size, (2, CFG.sequence_len + 1), generator=gen)  # the capture reads full rows
        idx[:, 0] = 0
        data.append((idx[:, :-1], idx[:, 1:]))
    acc = capture(model, iter(data), 2, bos=0, cfg=CaptureConfig(token_sample=1000, state_sample=1000))
    per_batch = [by_hand(model, i)[0] for i, _ in data]
    states = [torch.cat([s.reshape(-1, CFG.n_embd) for s in ss]).double() for ss in zip(*per_batch)]
    n = states[0].size(0)
    assert acc.tokens == n == 2 * 2 * CFG.sequence_len
    norms = torch.stack([s.norm(dim=1) for s in states], 1)
    assert (acc.sums["norm"] / n).tolist() == pytest.approx(norms.mean(0).tolist(), rel=1e-5)
    kept = acc.state_res.get("state").double()  # every token kept: the residual vectors themselves, in some order
    for k in (1, 2 * CFG.n_layer - 1, 2 * CFG.n_layer):
        got = sorted(kept[:, k].norm(dim=1).tolist())
        assert got == pytest.approx(sorted(norms[:, k].tolist()), rel=1e-5), k
    logits = torch.cat([model(i).reshape(-1, CFG.vocab_size) for i, _ in data])
    loss = torch.nn.functional.cross_entropy(logits, torch.cat([t.flatten() for _, t in data]))
    assert acc.sums["loss"].item() / n == pytest.approx(loss.item(), rel=1e-5)


# ---------------------------------------------------------------------------
# the Hugging Face export (scripts/export_hf.py's conversion, nag/hf/'s model)


@pytest.mark.parametrize("arch", list(ARMS))
@torch.no_grad()
def test_hf_export_gives_the_native_logits_and_generation(arch):
    pytest.importorskip("transformers")
    from scripts import export_hf
    from nag.hf.modeling_nagchat import NagChatForCausalLM

    assert arch in export_hf.ARCHS
    kwargs = {"layerrope": LAYERROPE_INITS["depth"]} if arch == "gpt-layerrope" else {}
    model = shake(twins(ARMS[arch], **kwargs)[1])
    meta = {"arch": model.arch, "model_config": model.config.to_dict(), **model.extra_meta()}
    bos = CFG.vocab_size - 1
    hf = NagChatForCausalLM(export_hf.hf_config(meta, bos, bos - 1))
    hf.load_state_dict(export_hf.hf_state_dict(model), strict=True)
    hf.eval()
    idx = tokens(B=3, T=24, seed=4)
    assert (hf(idx).logits - model(idx)).abs().max().item() < 1e-5
    prompt = [bos] + tokens(B=1, T=5, seed=8)[0].tolist()
    want = list(generate(model, prompt, 20, temperature=0))
    want = want[: want.index(bos) + 1] if bos in want else want  # transformers stops at eos = bos
    got = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False)[0, len(prompt) :].tolist()
    assert got == want and len(got) > 3, (got, want)
