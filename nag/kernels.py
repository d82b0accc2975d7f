"""
Fused Triton kernels for one NAG residual update (docs/design.md §4).

fused_nag_branch has the signature and results of nag.functional.nag_branch,
but does one pass over each token row: modulator, gain, centring,
orthogonalisation, N_out, update, renorm and log-norm update. The backward
pass recomputes the row quantities from the inputs instead of saving D-sized
intermediates, so the update costs no activation memory beyond its inputs.

Both passes are torch.library custom ops (nag::fused_branch and
nag::fused_branch_backward) tied together with register_autograd, so a
torch.compile'd model treats the update as one opaque node without a graph
break. We use custom_op rather than triton_op: triton_op traces its body with
fake tensors, which cannot work for kernels running in Triton's interpreter,
and Inductor could not fuse this kernel with its neighbours anyway.

Computation is in fp32 inside the kernels whatever the input dtype; outputs
and gradients come back in the dtype of the matching input.
Shapes follow nag.functional: rows (..., D), log_norm (..., 1), mod_logits
(..., C), coef (C,), beta_raw (1,), alpha (1,); leading dims are flattened.
"""

import os
import math

import torch

# nag/__init__.py has set TRITON_INTERPRET=1 on machines without a GPU (before triton was imported)
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from nag.functional import ORTHO_EPS, RMS_EPS, check_renorm  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1" and isinstance(tl.sum, triton.runtime.jit.JITFunction):
    # triton.language was imported (e.g. by torch._functorch or torch._inductor) before nag set the flag:
    # its library functions (tl.sum, tl.sigmoid) are then compiled-only, and the interpreter cannot run them
    raise ImportError("Triton was imported before nag on a machine without a GPU, so its interpreter cannot run "
                      "the fused kernels: import nag before torch._functorch, torch._inductor or triton")

# -----------------------------------------------------------------------------
# Row math shared by the forward and backward kernels


@triton.jit
def _log1p(x):
    # log(1 + x) would lose x below fp32 epsilon (tiny gains at the floor);
    # Goldberg's correction keeps it exact to rounding
    w = 1.0 + x
    small = w == 1.0
    return tl.where(small, x, tl.log(w) * (x / tl.where(small, 1.0, w - 1.0)))


@triton.jit
def _gate(logits_ptr, weights_ptr, beta_ptr, alpha_ptr, row, floor, C, BLOCK_C: tl.constexpr):
    """Modulator and gain of one row: returns (sigmoids, weights, u, clamped u, m, g, β, α)."""
    cols = tl.arange(0, BLOCK_C)
    mask = cols < C
    z = tl.load(logits_ptr + row * C + cols, mask=mask, other=0.0).to(tl.float32)
    weights = tl.load(weights_ptr + cols, mask=mask, other=0.0)  # 0 on padding: no effect on u
    sig = tl.sigmoid(z)
    u = tl.sum(weights * sig, axis=0)
    u_clamped = tl.maximum(u, floor)
    beta = tl.load(beta_ptr)
    alpha = tl.load(alpha_ptr)
    m = tl.exp2(beta * tl.log2(u_clamped))  # u_clamped ** beta, and 0 ** beta = 0
    return sig, weights, u, u_clamped, m, alpha * m, beta, alpha


@triton.jit
def _n_out(res, x, mask, D, sqrt_d, ORTHO_EPS: tl.constexpr):
    """N_out of one row: returns (x_c, along, ⟨R̄,R̄⟩, x_⊥, 1/‖x_⊥‖, o)."""
    x_c = tl.where(mask, x - tl.sum(x, axis=0) / D, 0.0)
    res_sq = tl.sum(res * res, axis=0)
    along = tl.sum(x_c * res, axis=0) / res_sq
    x_perp = x_c - along * res
    inv_norm = tl.rsqrt(tl.sum(x_perp * x_perp, axis=0) + ORTHO_EPS)
    return x_c, along, res_sq, x_perp, inv_norm, x_perp * (sqrt_d * inv_norm)


# -----------------------------------------------------------------------------
# Kernels: one program per row


@triton.jit
def _nag_forward_kernel(
    res_ptr, log_norm_ptr, branch_ptr, logits_ptr, weights_ptr, beta_ptr, alpha_ptr,
    new_res_ptr, new_log_norm_ptr,
    floor, D, C, sqrt_d,
    BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr, PREDICTED: tl.constexpr,
    ORTHO_EPS: tl.constexpr, RMS_EPS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    _, _, _, _, _, g, _, _ = _gate(logits_ptr, weights_ptr, beta_ptr, alpha_ptr, row, floor, C, BLOCK_C)
    res = tl.load(res_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(branch_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
    _, _, _, _, _, o = _n_out(res, x, mask, D, sqrt_d, ORTHO_EPS)
    y = res + g * o
    if PREDICTED:
        new_res = y * tl.rsqrt(1.0 + g * g)
    else:
        new_res = y * tl.rsqrt(tl.sum(y * y, axis=0) / D + RMS_EPS)
    tl.store(new_res_ptr + row * D + cols, new_res.to(new_res_ptr.dtype.element_ty), mask=mask)
    log_norm = tl.load(log_norm_ptr + row).to(tl.float32)
    new_log_norm = log_norm + 0.5 * _log1p(g * g)
    tl.store(new_log_norm_ptr + row, new_log_norm.to(new_log_norm_ptr.dtype.element_ty))


@triton.jit
def _nag_backward_kernel(
    res_ptr, branch_ptr, logits_ptr, weights_ptr, beta_ptr, alpha_ptr,
    grad_new_res_ptr, grad_new_log_norm_ptr,
    grad_res_ptr, grad_branch_ptr, grad_logits_ptr,
    part_weights_ptr, part_beta_ptr, part_alpha_ptr,
    floor, D, C, sqrt_d,
    BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr, PREDICTED: tl.constexpr,
    ORTHO_EPS: tl.constexpr, RMS_EPS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    # recompute the forward row
    sig, weights, u, u_clamped, m, g, beta, alpha = _gate(
        logits_ptr, weights_ptr, beta_ptr, alpha_ptr, row, floor, C, BLOCK_C)
    res = tl.load(res_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(branch_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
    x_c, along, res_sq, x_perp, inv_norm, o = _n_out(res, x, mask, D, sqrt_d, ORTHO_EPS)
    y = res + g * o

    grad_new_res = tl.load(grad_new_res_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
    grad_new_log_norm = tl.load(grad_new_log_norm_ptr + row).to(tl.float32)
    grad_g = grad_new_log_norm * g / (1.0 + g * g)
    # renorm
    if PREDICTED:
        scale = tl.rsqrt(1.0 + g * g)
        grad_y = scale * grad_new_res
        grad_g -= g * scale * scale * scale * tl.sum(grad_new_res * y, axis=0)
    else:
        scale = tl.rsqrt(tl.sum(y * y, axis=0) / D + RMS_EPS)
        new_res = y * scale
        grad_y = scale * (grad_new_res - new_res * (tl.sum(new_res * grad_new_res, axis=0) / D))
    # y = R̄ + g·o
    grad_res = grad_y
    grad_g += tl.sum(grad_y * o, axis=0)
    grad_o = g * grad_y
    # o = √D · x_⊥ / ‖x_⊥‖
    grad_perp = (sqrt_d * inv_norm) * (grad_o - x_perp * (inv_norm * inv_norm * tl.sum(x_perp * grad_o, axis=0)))
    # x_⊥ = x_c − along·R̄, along = ⟨x_c,R̄⟩/⟨R̄,R̄⟩
    grad_along = -tl.sum(grad_perp * res, axis=0)
    grad_centred = grad_perp + (grad_along / res_sq) * res
    grad_res += -along * grad_perp + (grad_along / res_sq) * (x_c - 2.0 * along * res)
    # x_c = x − mean(x)
    grad_x = grad_centred - tl.sum(tl.where(mask, grad_centred, 0.0), axis=0) / D
    tl.store(grad_res_ptr + row * D + cols, grad_res.to(grad_res_ptr.dtype.element_ty), mask=mask)
    tl.store(grad_branch_ptr + row * D + cols, grad_x.to(grad_branch_ptr.dtype.element_ty), mask=mask)

    # gate: g = α·m, m = max(u, floor)^β, u = Σ w_i σ(z_i)
    tl.store(part_alpha_ptr + row, grad_g * m)
    grad_m = grad_g * alpha
    # like torch.pow, the exponent's gradient is 0 where the base is 0
    log_u = tl.log(tl.where(u_clamped > 0.0, u_clamped, 1.0))
    tl.store(part_beta_ptr + row, grad_m * m * log_u)
    # β·u^(β−1) is inf at u == 0 for β < 1: kept, this is failure 1 with floor 0
    power = tl.where(beta == 1.0, 1.0, tl.exp2((beta - 1.0) * tl.log2(u_clamped)))
    # clamp passes the gradient where u ≥ floor, like torch.clamp
    grad_u = tl.where(u >= floor, grad_m * beta * power, 0.0)
    c_cols = tl.arange(0, BLOCK_C)
    c_mask = c_cols < C
    tl.store(part_weights_ptr + row * C + c_cols, grad_u * sig, mask=c_mask)
    grad_z = grad_u * weights * sig * (1.0 - sig)
    tl.store(grad_logits_ptr + row * C + c_cols, grad_z.to(grad_logits_ptr.dtype.element_ty), mask=c_mask)


# -----------------------------------------------------------------------------
# Launch helpers


def _rows(t, width):
    return t.reshape(-1, width).contiguous()


def _launch_config(dim, channels):
    block_d = triton.next_power_of_2(dim)
    block_c = triton.next_power_of_2(channels)
    num_warps = min(max(block_d // 256, 1), 16)
    return block_d, block_c, num_warps


def _gate_params(coef, beta_raw, alpha):
    # tiny per-call parameter transforms, passed to the kernels by pointer (no host sync)
    weights = torch.softmax(coef.float(), dim=-1).contiguous()
    beta = torch.nn.functional.softplus(beta_raw.float()).reshape(1).contiguous()
    return weights, beta, alpha.float().reshape(1).contiguous()


# -----------------------------------------------------------------------------
# Custom ops


@torch.library.custom_op("nag::fused_branch", mutates_args=())
def _fused_branch(
    res_dir: torch.Tensor, log_norm: torch.Tensor, branch_out: torch.Tensor, mod_logits: torch.Tensor,
    coef: torch.Tensor, beta_raw: torch.Tensor, alpha: torch.Tensor, floor: float, renorm: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    check_renorm(renorm)
    dim, channels = res_dir.size(-1), mod_logits.size(-1)
    res = _rows(res_dir, dim)
    rows = res.size(0)
    log_norm_rows = _rows(log_norm, 1)
    branch = _rows(branch_out, dim)
    logits = _rows(mod_logits, channels)
    weights, beta, alpha_ = _gate_params(coef, beta_raw, alpha)
    new_res = torch.empty_like(res)
    new_log_norm = torch.empty_like(log_norm_rows)
    block_d, block_c, num_warps = _launch_config(dim, channels)
    if rows > 0:
        _nag_forward_kernel[(rows,)](
            res, log_norm_rows, branch, logits, weights, beta, alpha_,
            new_res, new_log_norm,
            float(floor), dim, channels, math.sqrt(dim),
            BLOCK_D=block_d, BLOCK_C=block_c, PREDICTED=renorm == "predicted",
            ORTHO_EPS=ORTHO_EPS, RMS_EPS=RMS_EPS, num_warps=num_warps,
        )
    return new_res.view(res_dir.shape), new_log_norm.view(log_norm.shape)


def _fresh(t):
    # what the real ops allocate: t's shape, dtype and device, contiguous whatever t's strides
    # (empty_like alone keeps a dense input's strides, a transposed one's included)
    return torch.empty_like(t, memory_format=torch.contiguous_format)


@_fused_branch.register_fake
def _(res_dir, log_norm, branch_out, mod_logits, coef, beta_raw, alpha, floor, renorm):
    return _fresh(res_dir), _fresh(log_norm)


@torch.library.custom_op("nag::fused_branch_backward", mutates_args=())
def _fused_branch_backward(
    grad_new_dir: torch.Tensor, grad_new_log_norm: torch.Tensor,
    res_dir: torch.Tensor, branch_out: torch.Tensor, mod_logits: torch.Tensor,
    coef: torch.Tensor, beta_raw: torch.Tensor, alpha: torch.Tensor, floor: float, renorm: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns the gradients of (res_dir, branch_out, mod_logits, coef, beta_raw, alpha)."""
    check_renorm(renorm)
    dim, channels = res_dir.size(-1), mod_logits.size(-1)
    res = _rows(res_dir, dim)
    rows = res.size(0)
    branch = _rows(branch_out, dim)
    logits = _rows(mod_logits, channels)
    grad_new_res = _rows(grad_new_dir, dim)
    grad_new_log_norm = _rows(grad_new_log_norm, 1)
    weights, beta, alpha_ = _gate_params(coef, beta_raw, alpha)
    grad_res = torch.empty_like(res)
    grad_branch = torch.empty_like(branch)
    grad_logits = torch.empty_like(logits)
    # per-row partials of the parameter gradients, summed below: deterministic, no atomics
    part_weights = torch.empty(rows, channels, dtype=torch.float32, device=res.device)
    part_beta = torch.empty(rows, dtype=torch.float32, device=res.device)
    part_alpha = torch.empty(rows, dtype=torch.float32, device=res.device)
    block_d, block_c, num_warps = _launch_config(dim, channels)
    if rows > 0:
        _nag_backward_kernel[(rows,)](
            res, branch, logits, weights, beta, alpha_,
            grad_new_res, grad_new_log_norm,
            grad_res, grad_branch, grad_logits,
            part_weights, part_beta, part_alpha,
            float(floor), dim, channels, math.sqrt(dim),
            BLOCK_D=block_d, BLOCK_C=block_c, PREDICTED=renorm == "predicted",
            ORTHO_EPS=ORTHO_EPS, RMS_EPS=RMS_EPS, num_warps=num_warps,
        )
    # chain through softmax(coef) and softplus(beta_raw)
    grad_weights = part_weights.sum(dim=0)
    grad_coef = weights * (grad_weights - (weights * grad_weights).sum())
    grad_beta_raw = part_beta.sum().reshape(1) * torch.sigmoid(beta_raw.float().reshape(1))
    grad_alpha = part_alpha.sum().reshape(1)
    return (
        grad_res.view(res_dir.shape),
        grad_branch.view(branch_out.shape),
        grad_logits.view(mod_logits.shape),
        grad_coef.to(coef.dtype),
        grad_beta_raw.to(beta_raw.dtype).view(beta_raw.shape),
        grad_alpha.to(alpha.dtype).view(alpha.shape),
    )


@_fused_branch_backward.register_fake
def _(grad_new_dir, grad_new_log_norm, res_dir, branch_out, mod_logits, coef, beta_raw, alpha, floor, renorm):
    # each gradient in its input's dtype and shape (the parameter ones are reduced in fp32, then cast)
    return _fresh(res_dir), _fresh(branch_out), _fresh(mod_logits), _fresh(coef), _fresh(beta_raw), _fresh(alpha)


def _setup_context(ctx, inputs, output):
    res_dir, log_norm, branch_out, mod_logits, coef, beta_raw, alpha, floor, renorm = inputs
    # inputs only: the backward kernel recomputes every row quantity
    ctx.save_for_backward(res_dir, branch_out, mod_logits, coef, beta_raw, alpha)
    ctx.floor, ctx.renorm = floor, renorm


def _backward(ctx, grad_new_dir, grad_new_log_norm):
    res_dir, branch_out, mod_logits, coef, beta_raw, alpha = ctx.saved_tensors
    grad_res, grad_branch, grad_logits, grad_coef, grad_beta_raw, grad_alpha = _fused_branch_backward(
        grad_new_dir, grad_new_log_norm, res_dir, branch_out, mod_logits, coef, beta_raw, alpha,
        ctx.floor, ctx.renorm)
    # new_log_norm = log_norm + f(g), so log_norm's gradient passes straight through
    return grad_res, grad_new_log_norm, grad_branch, grad_logits, grad_coef, grad_beta_raw, grad_alpha, None, None


_fused_branch.register_autograd(_backward, setup_context=_setup_context)


def fused_nag_branch(res_dir, log_norm, branch_out, mod_logits, coef, beta_raw, alpha, floor, renorm="measured"):
    """Fused nag.functional.nag_branch: returns (new_dir, new_log_norm), log_norm shaped (..., 1)."""
    check_renorm(renorm)  # raise here, not deep inside a compiled graph
    return _fused_branch(res_dir, log_norm, branch_out, mod_logits, coef, beta_raw, alpha, float(floor), renorm)
