"""Mixture-of-Depths: NAG-MoD (rotation score) and the router-MoD baseline (paper eq. 40)."""

import json
import os

import pytest
import torch

from conftest import TINY_TRAIN
from nanochat.gpt import GPT, GPTConfig
from nag.model import NAGGPT, NAGConfig
from nag.mod import (
    ModConfig,
    Thresholds,
    attention_executed,
    mlp_executed,
    batch_threshold,
    calibrate,
    capacity,
    overflow_warning,
    savable_flops,
    skip_summary,
)
from nag.router_mod import RouterMoDGPT
from nag import archs
from scripts import base_train, base_eval

CFG = dict(sequence_len=32, vocab_size=128, n_layer=3, n_head=2, n_kv_head=2, n_embd=32)


def build(cls, seed=0, **kw):
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = cls(GPTConfig(**CFG), **kw)
    model.to_empty(device="cpu")
    model.init_weights()
    return model


def nag(mod=None, seed=0):
    return build(NAGGPT, seed, nag=NAGConfig(alpha_warmup_tokens=0), mod=mod)


@torch.no_grad()
def wake(model, seed=1, x_too=True):
    """Non-zero output projections (zero at init) and X_l, so that every path carries a signal."""
    g = torch.Generator().manual_seed(seed)
    for block in model.blocks:
        for lin in (block.attn.c_proj, block.mlp.c_proj):
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) * 0.1)
    if x_too and getattr(model, "mod_base", None) is not None:
        for v in model.mod_base.values():
            v.copy_(torch.randn(v.shape, generator=g) * 0.1)
    return model


def tokens(b=4, t=32, seed=0):
    return torch.randint(0, 128, (b, t), generator=torch.Generator().manual_seed(seed))


def ran(execute, cap):
    """The tokens that run: the first `cap` executed ones of each row of execute, as a mask of its shape."""
    return execute & (execute.cumsum(dim=1) <= cap)


# ---------------------------------------------------------------------------
# model-level


def test_rate_zero_equals_plain_nag():
    x = tokens()
    plain, moded = wake(nag()), wake(nag(ModConfig("both", 0.0)), x_too=False)  # X_l as initialised
    for mode in ("train", "eval"):
        plain.train(mode == "train")
        moded.train(mode == "train")
        assert torch.allclose(plain(x), moded(x), atol=1e-6, rtol=0)


@pytest.mark.parametrize("blocks", ["attn", "mlp", "both"])
def test_realised_skip_rate_is_near_target_on_a_training_batch(blocks):
    # 2,048 tokens per layer: a fixed (running) threshold still meets the sampling noise of a batch,
    # about √(0.3·0.7/N) (1 point here; 2 points at 512 tokens). Attention layer 0 of this model passes almost every
    # token, and the capacity (24 of 32) skips a quarter of them: the shortfall control offsets it in the other layers
    model = wake(nag(ModConfig(blocks, 0.3)))
    with torch.no_grad():
        for s in range(20):  # the running attention threshold settles
            model(tokens(64, 32, seed=s))
        model.thresholds.pop_rates("train")
        model(tokens(64, 32, seed=99))
    rates = model.thresholds.pop_rates("train")
    kinds = ["attn", "mlp"] if blocks == "both" else [blocks]
    assert {k for k, _ in rates} == set(kinds)
    for kind in kinds:
        vals = [r for (k, _), r in rates.items() if k == kind]
        assert abs(sum(vals) / len(vals) - 0.3) < 0.02, (kind, vals)
    for (kind, _), r in rates.items():
        if kind == "mlp":  # a batch quantile per layer: exact up to ties
            assert abs(r - 0.3) < 0.02


@pytest.mark.parametrize("window", ["L", "SL"])
def test_gathered_computation_equals_masked_full_computation(window):
    torch.manual_seed(0)
    cfg = dict(CFG, window_pattern=window, n_kv_head=1)
    with torch.device("meta"):
        model = GPT(GPTConfig(**cfg))
    model.to_empty(device="cpu")
    model.init_weights()
    wake(model)
    x = torch.randn(3, 32, 32)
    execute = torch.rand(3, 32) > 0.4
    execute[2] = False  # a row with nothing to run
    execute[1, :] = True  # a row with everything
    cos_sin = model.rotary(32)
    first16 = ran(execute, 16)
    assert first16[1].sum() == 16 and first16[0].sum() < execute[0].sum()  # rows that overflow a capacity of 16
    for block, mask in zip(model.blocks, model.attention_masks(32, "cpu")):
        full, mlp = block.attn(x, cos_sin, mask), block.mlp(x)
        want = full * execute[..., None]
        assert torch.allclose(attention_executed(block.attn, x, cos_sin, mask, execute), want, atol=1e-5)
        assert torch.allclose(mlp_executed(block.mlp, x, execute), mlp * execute[..., None], atol=1e-6)
        # a capacity of 16 per row: the first 16 executed tokens of each row run, the rest overflow (0)
        got = attention_executed(block.attn, x, cos_sin, mask, execute, 16)
        assert torch.allclose(got, full * first16[..., None], atol=1e-5)
        assert torch.allclose(mlp_executed(block.mlp, x, execute, 16), mlp * first16[..., None], atol=1e-6)
        # the batch packed as one row (training's MLP) with room for every executed token: padding dropped
        flat = mlp_executed(block.mlp, x, execute.reshape(1, -1), 80)
        assert torch.equal(flat != 0, mlp_executed(block.mlp, x, execute) != 0)
        assert torch.allclose(flat, mlp * execute[..., None], atol=1e-6)
    # packed evaluation rows: positions and an allowed mask
    positions = torch.arange(32).repeat(3, 1)
    allowed = positions[:, :, None] >= positions[:, None, :]
    cos_sin = model.rotary(32, positions)
    mask = model.attention_masks(32, "cpu", positions, allowed)[0]
    block = model.blocks[0]
    want = block.attn(x, cos_sin, mask) * execute[..., None]
    assert torch.allclose(attention_executed(block.attn, x, cos_sin, mask, execute), want, atol=1e-5)


@pytest.mark.parametrize("cap", [None, 8])
def test_a_sublayer_that_runs_no_token_still_gives_every_parameter_a_gradient(cap):
    # DDP (find_unused_parameters=False) needs a gradient for every parameter on every rank: a sub-layer whose
    # tokens all skip runs on one padded row whose result is dropped, so its gradient is there and zero
    model = wake(build(GPT))
    block, cos_sin = model.blocks[0], model.rotary(32)
    x = torch.randn(2, 32, 32, requires_grad=True)
    nothing = torch.zeros(2, 32, dtype=torch.bool)
    out = attention_executed(block.attn, x, cos_sin, None, nothing, cap) + mlp_executed(block.mlp, x, nothing, cap)
    assert not out.any()
    out.square().sum().backward()
    for name, p in block.named_parameters():
        assert p.grad is not None and not p.grad.any(), name
    assert not x.grad.any()


def test_capacity_is_the_rows_share_rounded_up_to_a_tile():
    # min(T, ceil(T·(1 − rate)) rounded up to a multiple of min(128, max(8, T // 16)))
    assert capacity(2048, 0.2) == 1664 and capacity(2048, 0.4) == 1280  # 1638.4 → 13 tiles of 128; 1228.8 → 10
    assert capacity(256, 0.2) == 208 and capacity(32, 0.3) == 24  # the CPU demo's 16-token multiple; the tests' 8
    assert capacity(80, 0.7) == 24  # 80 · (1 − 0.7) is 24.000000000000004 in floats: 24, not 25 → 32
    assert capacity(64, 0.1) == 64 and capacity(2048, 0.05) == 2048 and capacity(32, 0.0) == 32  # nothing to save
    assert capacity(1, 0.5) == 1  # decoding one token


@pytest.mark.parametrize("cls", ["nag", "router"])
def test_mod_forwards_read_nothing_on_the_host_and_compile_to_one_graph(cls, monkeypatch):
    from torch._dynamo.testing import CompileCounter
    from nanochat import step_timer

    mod = ModConfig("both", 0.3)
    model = wake(nag(mod) if cls == "nag" else build(RouterMoDGPT, mod=mod))
    reads = []
    for owner, name in [(step_timer, "read_values"), (torch.Tensor, "item"), (torch.Tensor, "tolist")]:
        real = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, real=real, name=name, **k: (reads.append(name), real(*a, **k))[1])
    batches = [tokens(4, 32, seed=s) for s in range(3)]
    for mode in ("train", "eval"):
        model.train(mode == "train")
        with torch.no_grad():
            for x in batches:
                model(x)
        assert reads == [], (mode, reads)  # was: one read per attention layer (and per MLP layer in evaluation)
        # two other batches trace one graph with no break (fullgraph) and no recompile: the same shapes
        counter = CompileCounter()
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=False)
        with torch.no_grad():
            for x in batches[1:]:
                compiled(x)
        assert counter.frame_count == 1, mode
    monkeypatch.undo()
    torch._dynamo.reset()
    assert model.thresholds.pop_rates("eval")  # the forwards above were counted


def test_overflow_is_counted_and_training_mlp_never_overflows():
    th = Thresholds(1, ModConfig("both", 0.3))
    th.eval()
    th.values.fill_(0.5)
    score = torch.zeros(2, 32)
    score[0, :30] = torch.linspace(1, 0.6, 30)  # 30 tokens over the threshold, 6 more than a capacity of 24
    score[1, ::4] = 1  # 8 tokens
    execute, cap = th.decide("attn", 0, score, 24)
    want = score > 0.5
    want[0, 24:] = False  # the 6 lowest-scoring of row 0 overflow
    assert cap == 24 and torch.equal(execute, want)
    rates, overflow = th.pop_stats("eval")
    assert rates == {("attn", 0): 1 - (24 + 8) / 64} and overflow == {("attn", 0): (6 / 64, 0.5)}
    summary = skip_summary(rates, overflow)
    assert summary["overflow_attn"] == 6 / 64 and summary["overflow_rows"] == 0.5 and "overflow_mlp" not in summary
    # training's MLP packs its batch as one row of B·capacity, which its batch quantile never overflows (ties run fewer)
    th.train()
    for s in range(5):
        score = torch.randint(0, 3 + 100 * s, (4, 32), generator=torch.Generator().manual_seed(s)).float()
        execute, cap = th.decide("mlp", 0, score, capacity(32, 0.3))
        assert execute.shape == (1, 128) and cap == 4 * 24 and execute.sum() <= 128 - round(0.3 * 128)
    assert th.pop_stats("train")[1] == {("mlp", 0): (0.0, 0.0)}


def test_overflow_warning_names_the_rate_and_capacity():
    assert overflow_warning({"overflow_rows": 0.5, "rate": 0.2, "capacity": 208}) is None
    assert overflow_warning({}) is None
    line = overflow_warning({"overflow_rows": 0.75, "rate": 0.2, "capacity": 208})
    assert "75% of the rows" in line and "capacity of 208" in line and "--mod-rate 0.2" in line and "\n" not in line


def test_attention_quantile_at_a_tensor_rate_is_the_host_one():
    # finish() keeps the target plus the shortfall on the device: the same k as round(float(rate) * N), halves to even
    g = torch.Generator().manual_seed(0)
    for n, rate in [(10, 0.25), (10, 0.35), (8, 0.0625), (512, 0.3), (512, 0.0), (7, 0.95)]:
        scores = torch.randn(n, generator=g)
        r = torch.tensor([rate])
        assert torch.equal(batch_threshold(scores, r), batch_threshold(scores, float(r))), (n, rate)


def test_skipped_tokens_take_exactly_the_x_path(monkeypatch):
    model = wake(nag(ModConfig("both", 0.4)))
    seen = []
    fn = model.branch_fn
    monkeypatch.setattr(
        model,
        "branch_fn",
        lambda res_dir, log_norm, out, *a: (seen.append((res_dir, out)), fn(res_dir, log_norm, out, *a))[1],
    )
    decisions = []
    decide = model.thresholds.decide
    monkeypatch.setattr(model.thresholds, "decide", lambda *a: (decisions.append(decide(*a)), decisions[-1])[1])
    with torch.no_grad():
        model(tokens())
    cos_sin = model.rotary(32)
    assert len(seen) == 6 and len(decisions) == 6
    for l, ((res_dir, out), (execute, cap)) in enumerate(zip(seen, decisions)):
        block, kind = model.blocks[l // 2], ("attn", "mlp")[l % 2]
        x_l = model.mod_base[f"{kind}_{l // 2}"]
        execute = ran(execute, cap).reshape(4, 32)  # within the capacity (24 per row; the MLP's batch: 96)
        assert 0 < (~execute).sum() < execute.numel()
        assert torch.equal(out[~execute], x_l.expand(int((~execute).sum()), -1))  # exactly X_l
        full = block.attn(res_dir, cos_sin, None) if kind == "attn" else block.mlp(res_dir)
        assert torch.allclose(out[execute], full[execute] + x_l, atol=1e-5)


def test_gradients_reach_x_gates_and_router():
    model = wake(nag(ModConfig("both", 0.3)))
    x = tokens()
    model(x, x).backward()
    for name, p in model.named_parameters():
        if name.startswith(("mod_base", "gates")):
            assert p.grad is not None and p.grad.abs().sum() > 0, name
    router = wake(build(RouterMoDGPT, mod=ModConfig("both", 0.3)))
    router(x, x).backward()
    for name, p in router.routers.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("cls", ["nag", "router"])
def test_eval_path_ignores_later_tokens_and_other_rows(cls):
    model = wake(nag(ModConfig("both", 0.3)) if cls == "nag" else build(RouterMoDGPT, mod=ModConfig("both", 0.3)))
    calibrate(model, iter([(tokens(8, 32, seed=s),) for s in range(4)]), 4)
    assert model.thresholds.calibrated() and not model.training
    x = tokens(4, 32, seed=7)
    y = x.clone()
    y[0, 16:] = tokens(1, 16, seed=8)  # later tokens of row 0
    y[1:] = tokens(3, 32, seed=9)  # every other row
    with torch.no_grad():
        a, b = model(x), model(y)
        alone = model(x[:1, :16])
    rates = model.thresholds.pop_rates("eval")
    assert sum(rates.values()) / len(rates) > 0.2 and all(r > 0 for r in rates.values())  # the tokens did skip
    assert torch.allclose(a[0, :16], b[0, :16], atol=1e-5)
    assert torch.allclose(a[0, :16], alone[0], atol=1e-5)


def test_router_at_rate_zero_equals_gpt():
    x = tokens()
    gpt, router = wake(build(GPT)), wake(build(RouterMoDGPT, mod=ModConfig("both", 0.0)))
    assert torch.allclose(gpt(x), router(x), atol=1e-6, rtol=0)


def test_flop_accounting_for_a_known_configuration():
    # d = 32, 2 heads of 16, T = 32, 3 layers. Skipping saves per token (training, 6 FLOPs per weight):
    # attention: c_q + c_proj = 2·32·32 weights → 12,288, plus 12·2·16·32 = 12,288 of attention; MLP:
    # 2·4·32·32 → 49,152
    plain = nag()
    full = plain.estimate_flops()
    saved = savable_flops(plain)
    assert saved[("attn", 0)] == 24_576 and saved[("mlp", 2)] == 49_152
    assert nag(ModConfig("mlp", 0.25)).estimate_flops() == full - 3 * 12_288
    assert nag(ModConfig("attn", 0.5)).estimate_flops() == full - 3 * 12_288
    assert nag(ModConfig("both", 0.2)).estimate_flops() == full - round(0.2 * 3 * (24_576 + 49_152))
    # realised rates, per sub-layer
    skip = {("attn", 0): 0.5, ("mlp", 1): 0.1}
    assert nag(ModConfig("both", 0.2)).estimate_flops(skip) == full - round(0.5 * 24_576 + 0.1 * 49_152)
    router = build(RouterMoDGPT, mod=ModConfig("both", 0.2))
    gpt_full = build(GPT).estimate_flops() + 6 * 6 * 32  # six routers of 32 weights
    assert router.estimate_flops() == gpt_full - round(0.2 * 3 * (24_576 + 49_152))


# ---------------------------------------------------------------------------
# training, checkpoints, plans, bad input


def read_metrics(run_dir):
    return [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]


def test_iso_flop_plan_buys_more_steps(capsys):
    # the demo: 4 × 256, 4,096 tokens per step and vocab, 1e13 FLOPs
    common = ["--preset", "demo", "--arch", "nag", "--dry-run", "1"]
    full = base_train.main(common)
    mod = base_train.main(common + ["--mod-rate", "0.2"])
    assert mod["flops_per_token"] < full["flops_per_token"]
    assert mod["num_iterations"] == round(1e13 / (mod["flops_per_token"] * 4096)) > full["num_iterations"]
    assert mod["mod_config"] == {"blocks": "both", "rate": 0.2, "momentum": 0.9}
    router = base_train.main(
        ["--preset", "demo", "--arch", "gpt-router", "--dry-run", "1", "--mod-rate", "0.2", "--mod-blocks", "mlp"]
    )
    assert router["arch"] == "gpt-router" and router["run"] == "gpt-router-d4"


@pytest.mark.parametrize("variant", ["nag", "router"])
def test_training_records_skip_rates_and_checkpoint_round_trips_thresholds(run_base, variant, capsys):
    flags = ["--arch", "nag"] if variant == "nag" else ["--arch", "gpt-router"]
    run_dir = base_train.main(
        TINY_TRAIN
        + flags
        + [
            "--mod-rate",
            "0.25",
            "--run",
            "m",
            "--num-iterations",
            "4",
            "--eval-every",
            "2",
            "--nag-gate-log-every",
            "2",
        ]
    )
    rows = read_metrics(run_dir)
    for r in rows[1:]:
        assert set(r["mod"]["skip"]) == {"0.attn", "0.mlp", "1.attn", "1.mlp"}
        assert abs(r["mod"]["skip_mlp"] - 0.25) < 0.02 and 0 < r["mod"]["skip_attn"] < 1
        # 48 of a row's 64 tokens run at most; training's MLP never overflows (its batch quantile bounds the batch)
        assert r["mod"]["capacity"] == 48 and r["mod"]["overflow_mlp"] == 0 and 0 <= r["mod"]["overflow_attn"] < 1
        assert (
            0
            < r["mod"]["flops_per_token"]
            < json.load(open(os.path.join(run_dir, "config.json")))["flops_per_token"] * 1.5
        )
    # the untrained attention threshold passes more than 48 tokens in most rows of a sub-layer: one warning, not four
    overflowed = [r for r in rows[1:] if r["mod"]["overflow_rows"] > 0.5]
    assert len(overflowed) > 1 and capsys.readouterr().out.count("warning: MoD overflow") == 1
    model, meta = archs.load_model(run_dir)
    assert meta["mod_config"]["rate"] == 0.25 and meta["arch"] == ("nag" if variant == "nag" else "gpt-router")
    saved = torch.load(os.path.join(run_dir, "model_000004.pt"), weights_only=False)["model"]
    assert torch.equal(model.thresholds.values, saved["thresholds.values"]) and model.thresholds.calibrated()
    assert model.thresholds.values.abs().sum() > 0
    # the reload takes the same paths as the model that was saved
    x = tokens(2, 64, seed=3) % meta["model_config"]["vocab_size"]
    again, _ = archs.load_model(run_dir)
    with torch.no_grad():
        assert torch.equal(model(x), again(x))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--arch", "nag", "--mod-rate", "0.95"], "--mod-rate must be in [0, 0.95) (got 0.95)"),
        (["--arch", "nag", "--mod-rate", "-0.1"], "--mod-rate must be in [0, 0.95) (got -0.1)"),
        (["--arch", "nag", "--mod-blocks", "attn"], "--mod-blocks needs --mod-rate"),
        # a capacity of the whole row (T·0.9 = 57.6 → 64): nothing saved
        (["--arch", "nag", "--mod-rate", "0.1"], "--mod-rate 0.1 at --max-seq-len 64: each row would compute 64 of"),
        (["--arch", "gpt-router", "--mod-rate", "0.05"], "--mod-rate 0.05 at --max-seq-len 64: each row would"),
        (["--arch", "gpt-router"], "the router-MoD baseline needs --mod-rate"),
        (["--arch", "gpt", "--mod-rate", "0.2"], "--arch gpt has no Mixture-of-Depths"),
        (["--arch", "gpt-recipe", "--mod-rate", "0.2"], "--arch gpt-recipe has no Mixture-of-Depths"),
    ],
)
def test_bad_training_input_is_one_line(run_base, script_error, argv, message):
    err = script_error(base_train.main, *TINY_TRAIN, "--run", "bad", "--num-iterations", "2", *argv)
    assert message in err


def test_mod_rate_at_eval_on_a_plain_gpt_checkpoint_is_one_line(run_base, script_error):
    base_train.main(TINY_TRAIN + ["--arch", "gpt", "--run", "g", "--num-iterations", "1", "--eval-every", "-1"])
    small = ["--split-tokens", "256", "--device-batch-size", "4", "--device-type", "cpu"]
    err = script_error(base_eval.main, "--run", "g", "--eval", "bpb", "--mod-rate", "0.2", *small)
    assert "has no router" in err
    err = script_error(base_eval.main, "--run", "g", "--eval", "bpb", "--mod-rate", "0.2,1.5", *small)
    assert "--mod-rate must be in [0, 0.95) (got 1.5)" in err


def test_inference_curve_on_a_full_depth_nag_goes_into_eval_json_and_compare_plots_it(run_base, capsys):
    from analysis.compare.pair import compare

    for arch in ("gpt", "nag"):
        base_train.main(TINY_TRAIN + ["--arch", arch, "--run", arch, "--num-iterations", "4", "--eval-every", "-1"])
    splits = []
    loader = base_eval.data_loader
    with pytest.MonkeyPatch.context() as mp:  # which split each calibration and evaluation reads
        mp.setattr(base_eval, "data_loader", lambda *a, **k: (splits.append(a[3]), loader(*a, **k))[1])
        base_eval.main(
            [
                "--run",
                "nag",
                "--eval",
                "bpb",
                "--mod-rate",
                "0.3,0.1",
                "--split-tokens",
                "1024",
                "--device-batch-size",
                "4",
                "--mod-calib-tokens",
                "1024",
                "--device-type",
                "cpu",
            ]
        )
    # bpb (val, train), then per rate: calibration on train (rates > 0 only), evaluation on val
    assert splits == ["val", "train", "val", "train", "val", "train", "val"]
    ev = json.load(open(os.path.join(run_base, "runs", "nag", "eval.json")))
    pts = ev["mod_curve"]["points"]
    assert [p["rate"] for p in pts] == [0.0, 0.1, 0.3] and ev["mod_curve"]["blocks"] == "both"
    assert pts[0]["flops_frac"] == 1.0 and pts[0]["skip"] == {} and pts[0]["calib_tokens"] == 0
    assert 1.0 > pts[1]["flops_frac"] > pts[2]["flops_frac"]
    assert pts[2]["calib_tokens"] == 1024 and set(pts[2]["skip"]) == {"0.attn", "0.mlp", "1.attn", "1.mlp"}
    for p in pts[1:]:  # fixed thresholds on unseen tokens: near, not at, the target
        assert abs((p["skip_attn"] + p["skip_mlp"]) / 2 - p["rate"]) < 0.1
    assert ev["val_bpb"] is not None and abs(ev["val_bpb"] - pts[0]["val_bpb"]) < 1e-9  # rate 0 is the model itself
    for p in pts[1:]:  # each rate's cost against full depth, paired on the same val batches
        assert p["val_bpb_delta"] == pytest.approx(p["val_bpb"] - pts[0]["val_bpb"], abs=1e-9)
        assert p["val_bpb_delta_ci"][0] <= p["val_bpb_delta"] <= p["val_bpb_delta_ci"][1]
    assert "val_bpb_delta" not in pts[0] and "core" not in pts[0]  # no bundle: no CORE along the curve
    report = compare(["gpt", "nag"], out_dir=str(run_base / "report"))
    text = open(report).read()
    assert "## Mixture-of-Depths at inference" in text and "mod_curve.png" in text
    d = pts[2]
    assert f"{d['val_bpb_delta']:+.4f} ({d['val_bpb_delta_ci'][0]:+.4f} … {d['val_bpb_delta_ci'][1]:+.4f})" in text
    assert open(run_base / "report" / "mod_curve.png", "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_core_along_the_curve_with_paired_intervals(run_base, tmp_path, write_eval_bundle):
    words = "the of and model data token train loss layer weight gradient norm residual attention head vector".split()
    # varied contexts and choices, so that skipping 90% of the sub-layers changes some answers
    items = [
        {
            "query": " ".join(words[(i * 7 + j) % 16] for j in range(4 + i % 5)).capitalize(),
            "choices": [" " + words[(i * 3 + k * 5) % 16] for k in range(3)],
            "gold": i % 3,
        }
        for i in range(40)
    ]
    bundle = write_eval_bundle(tmp_path / "bundle", [("mc", "multiple_choice", 0, 33.3, items)])
    base_train.main(TINY_TRAIN + ["--arch", "nag", "--run", "nag", "--num-iterations", "4", "--eval-every", "-1"])
    base_eval.main(
        [
            "--run",
            "nag",
            "--eval",
            "core,bpb",
            "--eval-bundle",
            bundle,
            "--mod-rate",
            "0.9",
            "--split-tokens",
            "1024",
            "--device-batch-size",
            "4",
            "--mod-calib-tokens",
            "1024",
            "--device-type",
            "cpu",
        ]
    )
    ev = json.load(open(os.path.join(run_base, "runs", "nag", "eval.json")))
    full, skip = ev["mod_curve"]["points"]
    assert full["core"] == pytest.approx(ev["partial_core"], abs=1e-12)  # rate 0 scores what the model itself scores
    assert skip["core"] != full["core"]  # skipping changed answers: the sign of the delta below is visible
    assert skip["core_delta"] == pytest.approx(skip["core"] - full["core"], abs=1e-9)
    assert (
        skip["core_delta_ci"][0] <= skip["core_delta"] <= skip["core_delta_ci"][1]
        and skip["core_label"] == full["core_label"]
    )


def test_exact_resume_with_thresholds(run_base):
    common = TINY_TRAIN + [
        "--arch",
        "nag",
        "--mod-rate",
        "0.3",
        "--run",
        "r",
        "--num-iterations",
        "6",
        "--eval-every",
        "-1",
        "--save-every",
        "3",
    ]
    run_dir = base_train.main(common)
    full = read_metrics(run_dir)
    base_train.main(common + ["--resume", "3"])
    again = read_metrics(run_dir)
    assert [r["train_loss"] for r in again] == [r["train_loss"] for r in full]
    assert [r["mod"]["skip"] for r in again[1:]] == [r["mod"]["skip"] for r in full[1:]]


def test_bench_mod_prints_savings(capsys):
    from scripts.bench import mod as bench_mod

    rows = bench_mod.main(
        [
            "--depth",
            "2",
            "--model-dim",
            "64",
            "--head-dim",
            "32",
            "--max-seq-len",
            "32",
            "--vocab-size",
            "128",
            "--device-batch-size",
            "2",
            "--steps",
            "1",
            "--warmup",
            "1",
            "--rates",
            "0.4",
            "--blocks",
            "mlp,both",
        ]
    )
    out = capsys.readouterr().out
    assert "FLOPs saved" in out and "time saved" in out
    flops = {(b, r): row["flops"] for b, r, row in rows}
    assert flops[("none", 0.0)] > flops[("mlp", 0.4)] > flops[("both", 0.4)]


def test_attention_threshold_keeps_the_average_rate_when_scores_drift():
    # synthetic scores that rise every batch, as they do while the gates learn: the previous batch's
    # quantile alone would skip too little; the accumulated shortfall brings the average back to the target
    from nag.mod import Thresholds

    th = Thresholds(2, ModConfig("attn", 0.3))
    th.reset()
    th.train()
    g = torch.Generator().manual_seed(0)
    for step in range(60):
        for layer in range(2):
            th.decide("attn", layer, torch.rand(8, 64, generator=g) + 0.02 * step, 64)
        th.finish()
    rates = th.pop_rates("train")
    assert abs(sum(rates.values()) / len(rates) - 0.3) < 0.01


def test_a_compiled_mod_training_step_matches_the_eager_one():
    # base_train compiles MoD runs: the thresholds, their shortfall and the tallies are buffers updated in the graph
    model = wake(nag(ModConfig("both", 0.3)))
    start = {k: v.clone() for k, v in model.state_dict().items()}
    runs = []
    for compiled in (False, True):
        model.load_state_dict(start)
        model.thresholds.reset()
        torch._dynamo.reset()
        forward = torch.compile(model, backend="aot_eager", fullgraph=True, dynamic=False) if compiled else model
        losses, grads = [], []
        for s in range(2):
            x = tokens(4, 32, seed=s)
            loss = forward(x, x)
            loss.backward()
            losses.append(loss.detach())
            grads.append([p.grad.clone() for p in model.parameters()])
            model.zero_grad(set_to_none=True)
        runs.append((losses, grads, model.thresholds.values.clone(), model.thresholds.pop_stats("train")))
    torch._dynamo.reset()
    (eager, eager_grads, eager_values, eager_stats), (comp, comp_grads, comp_values, comp_stats) = runs
    assert torch.equal(torch.stack(eager), torch.stack(comp)) and torch.equal(eager_values, comp_values)
    assert all(torch.allclose(a, b, atol=1e-6) for g, h in zip(eager_grads, comp_grads) for a, b in zip(g, h))
    assert eager_stats == comp_stats
