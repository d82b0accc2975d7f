"""Tests of the NAG reference math (nag/functional.py), mostly in fp64."""

import math

import pytest
import torch

from nag.functional import modulator, nag_branch, residual_update

D = 48
C = 8


def unit_rms(t):
    return t * torch.rsqrt(t.pow(2).mean(dim=-1, keepdim=True))


def make_state(rows=6, dim=D, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    res_dir = unit_rms(torch.randn(rows, dim, generator=gen, dtype=torch.float64)).to(dtype)
    log_norm = torch.randn(rows, 1, generator=gen, dtype=torch.float64)
    branch_out = (3 * torch.randn(rows, dim, generator=gen, dtype=torch.float64) + 0.5).to(dtype)
    gain = torch.rand(rows, 1, generator=gen, dtype=torch.float64) * 2 - 0.5
    return res_dir, log_norm, branch_out, gain


def make_gates(rows=6, channels=C, dtype=torch.float64, seed=1):
    gen = torch.Generator().manual_seed(seed)
    mod_logits = (2 * torch.randn(rows, channels, generator=gen, dtype=torch.float64)).to(dtype)
    coef = torch.randn(channels, generator=gen, dtype=torch.float64)
    beta_raw = torch.tensor([0.3], dtype=torch.float64)
    alpha = torch.tensor([0.7], dtype=torch.float64)
    return mod_logits, coef, beta_raw, alpha


@pytest.mark.parametrize("renorm", ["measured", "predicted"])
def test_output_has_rms_one(renorm):
    res_dir, log_norm, branch_out, gain = make_state()
    new_dir, _ = residual_update(res_dir, log_norm, branch_out, gain, renorm=renorm)
    rms = new_dir.pow(2).mean(dim=-1).sqrt()
    torch.testing.assert_close(rms, torch.ones_like(rms), rtol=0, atol=1e-12)


def test_log_norm_increment():
    res_dir, log_norm, branch_out, gain = make_state()
    _, new_log_norm = residual_update(res_dir, log_norm, branch_out, gain)
    assert new_log_norm.shape == log_norm.shape
    torch.testing.assert_close(new_log_norm - log_norm, 0.5 * torch.log1p(gain**2), rtol=0, atol=1e-14)


def test_rotation_angle_is_arctan_gain():
    res_dir, log_norm, branch_out, gain = make_state()
    gain = gain.abs()  # a negative gain rotates by the same angle towards −o
    new_dir, _ = residual_update(res_dir, log_norm, branch_out, gain)
    cos = (new_dir * res_dir).sum(-1) / (new_dir.norm(dim=-1) * res_dir.norm(dim=-1))
    torch.testing.assert_close(torch.acos(cos.clamp(-1, 1)), torch.atan(gain[:, 0]), rtol=0, atol=1e-7)


def test_rotation_stays_in_plane_of_res_dir_and_branch():
    # the new direction is R̄ plus a multiple of the centred, orthogonalised output
    res_dir, log_norm, branch_out, gain = make_state()
    new_dir, _ = residual_update(res_dir, log_norm, branch_out, gain)
    x = branch_out - branch_out.mean(-1, keepdim=True)
    x = x - (x * res_dir).sum(-1, keepdim=True) / D * res_dir
    expected = unit_rms(res_dir + gain * math.sqrt(D) * x / x.norm(dim=-1, keepdim=True))
    torch.testing.assert_close(new_dir, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("renorm", ["measured", "predicted"])
def test_invariant_to_branch_scale_and_shift(renorm):
    res_dir, log_norm, branch_out, gain = make_state()
    base = residual_update(res_dir, log_norm, branch_out, gain, renorm=renorm)
    scaled = residual_update(res_dir, log_norm, 7.5 * branch_out, gain, renorm=renorm)
    shifted = residual_update(res_dir, log_norm, branch_out - 4.25, gain, renorm=renorm)
    for other in (scaled, shifted):
        torch.testing.assert_close(other[0], base[0], rtol=0, atol=1e-12)
        torch.testing.assert_close(other[1], base[1], rtol=0, atol=0)


def test_zero_gain_is_identity():
    res_dir, log_norm, branch_out, gain = make_state()
    new_dir, new_log_norm = residual_update(res_dir, log_norm, branch_out, torch.zeros_like(gain))
    torch.testing.assert_close(new_dir, res_dir, rtol=0, atol=1e-14)
    torch.testing.assert_close(new_log_norm, log_norm, rtol=0, atol=0)


def test_zero_branch_output_is_identity():
    # zero-initialised projections output exactly 0 at the first step
    res_dir, log_norm, branch_out, gain = make_state()
    new_dir, _ = residual_update(res_dir, log_norm, torch.zeros_like(branch_out), gain)
    torch.testing.assert_close(new_dir, res_dir, rtol=0, atol=1e-14)


def test_renorm_modes_agree():
    res_dir, log_norm, branch_out, gain = make_state()
    measured = residual_update(res_dir, log_norm, branch_out, gain, renorm="measured")
    predicted = residual_update(res_dir, log_norm, branch_out, gain, renorm="predicted")
    torch.testing.assert_close(measured[0], predicted[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(measured[1], predicted[1], rtol=0, atol=0)


def test_unknown_renorm_rejected():
    res_dir, log_norm, branch_out, gain = make_state()
    with pytest.raises(ValueError):
        residual_update(res_dir, log_norm, branch_out, gain, renorm="exact")


def test_keeps_dtypes_and_leading_dims():
    res_dir, log_norm, branch_out, gain = make_state(rows=6)
    res_dir = res_dir.to(torch.bfloat16).view(2, 3, D)
    branch_out = branch_out.to(torch.bfloat16).view(2, 3, D)
    log_norm = log_norm.float().view(2, 3, 1)
    gain = gain.float().view(2, 3, 1)
    new_dir, new_log_norm = residual_update(res_dir, log_norm, branch_out, gain)
    assert new_dir.dtype == torch.bfloat16 and new_dir.shape == (2, 3, D)
    assert new_log_norm.dtype == torch.float32 and new_log_norm.shape == (2, 3, 1)


@pytest.mark.parametrize("floor", [0.0, 1e-6, 0.2])
def test_modulator_range(floor):
    mod_logits, coef, beta_raw, _ = make_gates(rows=64)
    mod_logits = mod_logits * 10  # push some rows close to u = 0 and u = 1
    for raw in (-2.0, 0.5413, 2.0):
        beta_raw = torch.tensor([raw], dtype=torch.float64)
        beta = torch.nn.functional.softplus(beta_raw)
        m = modulator(mod_logits, coef, beta_raw, floor)
        assert m.shape == (64, 1)
        assert (m >= floor**beta).all() and (m <= 1).all()


def test_modulator_formula():
    mod_logits, coef, beta_raw, _ = make_gates(rows=5)
    m = modulator(mod_logits, coef, beta_raw, 1e-6)
    weights = torch.exp(coef) / torch.exp(coef).sum()
    u = (weights / (1 + torch.exp(-mod_logits))).sum(-1, keepdim=True)
    torch.testing.assert_close(m, u ** math.log1p(math.exp(0.3)), rtol=1e-12, atol=0)


def test_modulator_at_floor():
    # with every logit at −200, u == 0 and m sits exactly at floor^β
    mod_logits = torch.full((3, C), -200.0, dtype=torch.float64)
    _, coef, beta_raw, _ = make_gates()
    beta = torch.nn.functional.softplus(beta_raw)
    torch.testing.assert_close(modulator(mod_logits, coef, beta_raw, 1e-3), (1e-3**beta).expand(3, 1))


def modulator_grads_bf16(floor):
    mod_logits = torch.full((4, C), -200.0, dtype=torch.bfloat16, requires_grad=True)
    coef = torch.zeros(C, requires_grad=True)
    beta_raw = torch.tensor([-1.0], requires_grad=True)  # β = softplus(−1) ≈ 0.31 < 1
    modulator(mod_logits, coef, beta_raw, floor).sum().backward()
    return mod_logits.grad, coef.grad


def test_failure1_floor_zero_gives_nonfinite_grad_in_bf16():
    grad_logits, grad_coef = modulator_grads_bf16(0.0)
    assert not torch.isfinite(grad_logits).any()
    assert not torch.isfinite(grad_coef).all()


def test_failure1_fixed_by_floor():
    grad_logits, grad_coef = modulator_grads_bf16(1e-6)
    assert torch.isfinite(grad_logits).all() and torch.isfinite(grad_coef).all()


@pytest.mark.parametrize("renorm", ["measured", "predicted"])
def test_nag_branch_gradcheck(renorm):
    res_dir, log_norm, branch_out, _ = make_state(rows=3, dim=12)
    mod_logits, coef, beta_raw, alpha = make_gates(rows=3, channels=5)
    inputs = [t.clone().requires_grad_() for t in (res_dir, log_norm, branch_out, mod_logits, coef, beta_raw, alpha)]

    def fn(*args):
        return nag_branch(*args, floor=1e-6, renorm=renorm)

    assert torch.autograd.gradcheck(fn, inputs)


def test_nag_branch_matches_parts():
    res_dir, log_norm, branch_out, _ = make_state()
    mod_logits, coef, beta_raw, alpha = make_gates()
    new_dir, new_log_norm = nag_branch(res_dir, log_norm, branch_out, mod_logits, coef, beta_raw, alpha, 1e-6)
    gain = alpha * modulator(mod_logits, coef, beta_raw, 1e-6)
    ref_dir, ref_log_norm = residual_update(res_dir, log_norm, branch_out, gain)
    torch.testing.assert_close(new_dir, ref_dir, rtol=0, atol=0)
    torch.testing.assert_close(new_log_norm, ref_log_norm, rtol=0, atol=0)
    # the gain really moves the state: log_norm grows by ½·log1p(g²) > 0
    assert (new_log_norm > log_norm).all()


def test_alpha_scale_is_a_constant_factor_of_alpha():
    # the model passes the warm-up factor as alpha_scale: the same update as the scaled α, and the factor
    # itself gets no gradient (it is a schedule, not a parameter)
    res_dir, log_norm, branch_out, _ = make_state()
    mod_logits, coef, beta_raw, alpha = make_gates()
    scale = torch.tensor([0.25], dtype=torch.float64, requires_grad=True)
    scaled = nag_branch(res_dir, log_norm, branch_out, mod_logits, coef, beta_raw, alpha, 1e-6, alpha_scale=scale)
    direct = nag_branch(res_dir, log_norm, branch_out, mod_logits, coef, beta_raw, alpha * 0.25, 1e-6)
    for a, b in zip(scaled, direct):
        torch.testing.assert_close(a, b)
    assert not scaled[0].requires_grad
