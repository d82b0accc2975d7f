"""The plan of a run: the published preset's horizon and optimizer settings, as base_train builds them."""

import json
import math

import pytest
import torch

from nag.archs import plan_for
from nanochat.plan import momentum_at
from scripts import base_train
from nanochat.optim import orthogonalize, POLAR_EXPRESS_COEFFS, MuonAdamW


def published(arch, nproc=8):
    args = base_train.parse_args(["--preset", "published", "--arch", arch])
    return args, plan_for(args, 32768, nproc)


@pytest.mark.parametrize("arch,steps,decay", [("gpt", 9474, 0.094355), ("nag", 9425, 0.094198)])
def test_published_horizon_and_weight_decay(arch, steps, decay):
    args, plan = published(arch)
    assert (plan.total_batch, plan.num_iterations) == (2**20, steps)
    assert plan.lr_scale == pytest.approx(math.sqrt(2))
    assert plan.weight_decay == pytest.approx(decay, abs=1e-6)
    # the rule by hand: 0.28 · √(B/2^19) · S_ref/S, with S_ref the 12-layer model of the same width and arch;
    # a NAG block adds two gates: m_down (640 → 32, with bias), coef (32), β_raw, α
    per_layer = 12 * 640**2 + (2 * (640 * 32 + 32 + 32 + 1 + 1) if arch == "nag" else 0)
    head = 32768 * 640
    assert plan.weight_decay == pytest.approx(
        0.28 * math.sqrt(2) * (12 * per_layer + head) / (64 * per_layer + head), rel=1e-12
    )


@pytest.mark.parametrize("arch,count,decay", [("gpt", 335_544_320, 0.0943546), ("nag", 338_174_208, 0.0941982)])
def test_published_scaling_params_as_the_published_code_counts_them(arch, count, decay):
    # S = every parameter under the blocks + lm_head (github.com/AlxSp/nag-nanochat: transformer_matrices + lm_head);
    # NAG's gate vectors included, whose 8,448 parameters move the decay in its 7th digit (0.0941987 without them)
    _, plan = published(arch)
    assert plan.model.num_scaling_params() == count
    assert round(plan.weight_decay, 7) == decay
    # the FLOPs stay 6 × matmul parameters + attention: the gate vectors do no matmul,
    # and the FLOP-matched horizon holds
    assert plan.flops_per_token == {"gpt": 3_019_898_880, "nag": 3_035_627_520}[arch]


def test_published_preset_keeps_the_momentum_schedule():
    args, plan = published("gpt")
    n, wd = plan.num_iterations, plan.warmdown_steps
    start = n - wd
    m = lambda s: momentum_at(s, plan)
    assert m(0) == pytest.approx(0.85)
    assert m(200) == pytest.approx(0.91)
    assert m(400) == pytest.approx(0.97)
    assert m(start) == pytest.approx(0.97)  # constant from step 400 to the warm-down
    assert m((start + n) // 2) == pytest.approx(0.97 - 0.07 * ((start + n) // 2 - start) / wd)
    assert m(n) == pytest.approx(0.90)
    assert m(n - 1) == pytest.approx(0.90 + 0.07 / wd)


def test_published_optimizer_groups_as_built():
    args, plan = published("nag")
    opt = MuonAdamW(plan.optimizer_groups(args))
    groups = {g["name"].split("[")[0]: g for g in opt.param_groups}
    dim_scale, lr_scale = (640 / 768) ** -0.5, math.sqrt(2)
    assert groups["wte"]["betas"] == (0.8, 0.995) and groups["wte"]["weight_decay"] == 0.001
    assert groups["wte"]["lr"] == pytest.approx(0.18 * dim_scale * lr_scale)
    assert groups["lm_head"]["betas"] == (0.8, 0.96) and groups["lm_head"]["weight_decay"] == 0.01
    assert groups["lm_head"]["lr"] == pytest.approx(0.006 * dim_scale * lr_scale)
    assert groups["nag_gates"]["weight_decay"] == 0 and groups["nag_gates"]["lr"] == pytest.approx(1e-3 * lr_scale)
    assert groups["nag_temp_gain"]["weight_decay"] == 0
    for g in opt.param_groups:
        assert g["eps"] == 1e-10
        if g["kind"] == "muon":
            assert g["lr"] == pytest.approx(0.012 * lr_scale) and g["beta2"] == 0.9
            assert g["weight_decay"] == pytest.approx(0.094198, abs=1e-6)


def test_polar_express_normalises_by_1_01():
    torch.manual_seed(0)
    G = torch.randn(1, 6, 4, dtype=torch.float64)
    X = G / (G.norm() * 1.01 + 1e-6)  # the direct computation, on the tall matrix's transpose
    X = X.mT
    for a, b, c in POLAR_EXPRESS_COEFFS:
        A = X @ X.mT
        X = a * X + (b * A + c * (A @ A)) @ X
    assert torch.allclose(orthogonalize(G, torch.float64), X.mT, atol=1e-12)
    # 1.02 would give a visibly different result: the check can tell the factors apart
    Y = (G / (G.norm() * 1.02 + 1e-6)).mT
    for a, b, c in POLAR_EXPRESS_COEFFS:
        B = Y @ Y.mT
        Y = a * Y + (b * B + c * (B @ B)) @ Y
    assert not torch.allclose(orthogonalize(G, torch.float64), Y.mT, atol=1e-6)


def test_dry_run_plan_carries_the_optimizer(capsys):
    base_train.main(["--preset", "published", "--arch", "gpt", "--dry-run", "8"])
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("PLAN "))
    opt = json.loads(line[5:])["optimizer"]
    assert opt["polar_norm_factor"] == 1.01 and opt["normuon_beta2"] == 0.9
    assert opt["muon_momentum"] == {
        "start": 0.85,
        "peak": 0.97,
        "peak_step": 400,
        "end": 0.9,
        "end_step": 9474,
        "warmdown_start_step": 9474 - 6158,
    }
    assert opt["muon_weight_decay"]["value"] == pytest.approx(0.094355, abs=1e-6)
    names = {g["name"]: g for g in opt["groups"]}
    assert names["lm_head"]["betas"] == [0.8, 0.96] and names["wte"]["weight_decay"] == 0.001
    assert all(g["lr_at_step0"] == pytest.approx(g["lr"] / 40) for g in opt["groups"])  # warm-up step 1 of 40


@pytest.mark.parametrize(
    "name, tflops",
    [
        ("NVIDIA H100 80GB HBM3", 989),
        ("NVIDIA H100 PCIe", 756),
        ("NVIDIA H100 NVL", 835),
        ("NVIDIA H200", 989),
        ("NVIDIA H200 NVL", 836),
        ("NVIDIA H800", 989),
        ("NVIDIA H800 PCIe", 756),
        ("NVIDIA A100-SXM4-80GB", 312),
        ("NVIDIA B200", 2250),
        ("NVIDIA GeForce RTX 4090", 165.2),
        ("NVIDIA L4", None),
    ],
)
def test_peak_flops_of_each_variant_and_none_for_an_unknown_gpu(name, tflops):
    """One table, exact variants: a PCIe or NVL part is not taken for the SXM one, and an unknown GPU has no MFU."""
    from nanochat.gpus import peak_flops_of

    peak = peak_flops_of(name)
    assert (peak is None and tflops is None) or peak == tflops * 1e12, (name, peak)


@pytest.mark.parametrize(
    "flag,value",
    [
        ("--num-iterations", "0"),
        ("--num-iterations=-5", None),
        ("--target-flops", "0"),
        ("--target-flops=-2e18", None),
        ("--target-param-data-ratio", "0"),
        ("--eval-every", "0"),
        ("--total-batch-size", "0"),
        ("--model-dim", "0"),
        ("--n-kv-head=-3", None),
        ("--save-every=-2", None),
        ("--target-flops", "inf"),
    ],
)
def test_a_non_positive_horizon_or_interval_is_one_line_with_what_minus_one_means(flag, value, script_error):
    """0 and other negatives used to mean "unset" too: --num-iterations 0 trained the automatic horizon, --target-flops
    0 planned 90,048 steps, --eval-every 0 never evaluated. The dry run plans nothing with them."""
    err = script_error(base_train.main, "--depth", "4", "--dry-run", "1", *([flag] if value is None else [flag, value]))
    assert err.startswith(f"error: {flag.split('=')[0]} must be") and ("-1 (" in err or "the last step only" in err), (
        err
    )
    assert "\n" not in err.strip()


def test_minus_one_still_means_unset(capsys):
    """The documented -1: the horizon from the data ratio, never evaluate, a batch from the model size."""
    record = base_train.main(
        [
            "--depth",
            "4",
            "--dry-run",
            "1",
            "--num-iterations",
            "-1",
            "--target-flops",
            "-1",
            "--eval-every",
            "-1",
            "--total-batch-size",
            "-1",
            "--save-every",
            "0",
        ]
    )
    assert record["num_iterations"] > 0


def test_an_absurd_depth_is_refused_before_any_layer_is_built(script_error, monkeypatch):
    """`--depth 100000 --dry-run 1` used to print nothing for minutes: the plan builds every layer (on the meta
    device, a few ms each). Past MAX_DEPTH it is one line naming the limit, before any model is built."""
    from nanochat import plan as run_plan
    from nanochat.gpt import GPT

    def no_model(*args, **kwargs):
        raise AssertionError("a model was built")

    monkeypatch.setattr(GPT, "__init__", no_model)
    err = script_error(base_train.main, "--arch", "gpt", "--run", "x", "--depth", "100000", "--dry-run", "1")
    assert err.startswith("error: --depth 100000 is beyond 1024") and "MAX_DEPTH" in err
    run_plan.check_args(base_train.parse_args(["--depth", str(run_plan.MAX_DEPTH)]))  # the limit itself is planned
