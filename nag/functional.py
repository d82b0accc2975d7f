"""
Reference math of one NAG residual update (docs/design.md §4), in plain PyTorch.

Slow but obviously correct and autograd-friendly: the fused Triton kernels in
nag/kernels.py are tested against these functions, and the NAG model can fall
back to them anywhere Triton is unavailable.

Shapes and dtypes:
    res_dir     (..., D)  direction R̄ with RMS 1, compute dtype (bf16 or fp32)
    log_norm    (..., 1)  log of the carried norm s, fp32 (kept fp32 on purpose:
                          it accumulates one small increment per sub-layer)
    branch_out  (..., D)  raw sub-layer output x
    mod_logits  (..., C)  R̄·w_i + b_i for the C preferred directions
    coef        (C,)      softmax logits mixing the C sigmoids
    beta_raw    (1,)      softplus(beta_raw) is the modulator exponent β
    alpha       (1,)      α: the effective one, or the learned one when alpha_scale is given
    alpha_scale (1,)      optional constant factor of α (the warm-up), no gradient
    gain        (..., 1)  realised gain g; tan θ = g
"""

import math

import torch

# Guards against a zero-length orthogonal component (a zero-initialised branch
# outputs exactly 0): on the squared norm, i.e. a norm below ~1e-12 counts as zero.
ORTHO_EPS = 1e-24
# The measured renorm divides by the RMS of R̄ + g·o, which is ≥ ~1, so this eps
# only keeps the formula total.
RMS_EPS = 1e-20
RENORM_MODES = ("measured", "predicted")


def _work_dtype(dtype):
    # row reductions in fp32 at least (fp64 stays fp64 for gradcheck)
    return torch.promote_types(dtype, torch.float32)


def modulator(mod_logits, coef, beta_raw, floor):
    """m = max(u, floor) ** softplus(beta_raw), u = Σ_i softmax(coef)_i σ(mod_logits_i).

    Computed in mod_logits' dtype: in bf16 with floor 0, β < 1 and u == 0 the
    backward hits β·u^(β−1) = inf and the gradient turns non-finite (failure 1);
    the floor fixes it because clamp's gradient is zero below the floor.
    Returns shape (..., 1).
    """
    dtype = mod_logits.dtype
    weights = torch.softmax(coef, dim=-1, dtype=_work_dtype(coef.dtype)).to(dtype)
    u = (torch.sigmoid(mod_logits) * weights).sum(dim=-1, keepdim=True)
    beta = torch.nn.functional.softplus(beta_raw.to(_work_dtype(beta_raw.dtype))).to(dtype)
    return torch.clamp(u, min=floor) ** beta


def check_renorm(renorm):
    if renorm not in RENORM_MODES:
        raise ValueError(f"unknown renorm {renorm!r}, expected one of {RENORM_MODES}")


def residual_update(res_dir, log_norm, branch_out, gain, renorm="measured"):
    """Rotate the direction R̄ towards the normalised branch output by angle arctan(g).

    Returns (new_dir in res_dir's dtype, new_log_norm in log_norm's dtype).
    """
    check_renorm(renorm)
    dim = res_dir.size(-1)
    work = _work_dtype(res_dir.dtype)
    r = res_dir.to(work)
    x = branch_out.to(work)
    g = gain.to(work)
    # N_out: centre, remove the component along R̄, rescale to norm √D
    x = x - x.mean(dim=-1, keepdim=True)
    along = (x * r).sum(dim=-1, keepdim=True) / (r * r).sum(dim=-1, keepdim=True)
    x = x - along * r
    o = x * (math.sqrt(dim) * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + ORTHO_EPS))
    y = r + g * o
    if renorm == "measured":
        new_dir = y * torch.rsqrt((y * y).mean(dim=-1, keepdim=True) + RMS_EPS)
    else:
        # paper eq. 17: exact when R̄ is exactly RMS 1, since o ⟂ R̄ and ‖o‖ = √D
        new_dir = y * torch.rsqrt(1 + g * g)
    g_log = gain.to(log_norm.dtype)
    new_log_norm = log_norm + 0.5 * torch.log1p(g_log * g_log)
    return new_dir.to(res_dir.dtype), new_log_norm


def nag_branch(
    res_dir, log_norm, branch_out, mod_logits, coef, beta_raw, alpha, floor, renorm="measured", alpha_scale=None
):
    """One full NAG update: gain = alpha · alpha_scale · modulator(...), then residual_update."""
    if alpha_scale is not None:
        alpha = alpha * alpha_scale.detach()
    gain = alpha * modulator(mod_logits, coef, beta_raw, floor)
    return residual_update(res_dir, log_norm, branch_out, gain, renorm=renorm)
