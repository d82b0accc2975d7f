"""
Fused Triton kernels for one NAG residual update (docs/design.md §4).

fused_nag_branch has the signature and results of nag.functional.nag_branch,
but does one pass over each token row: modulator, gain, centring,
orthogonalisation, N_out, update, renorm and log-norm update. The backward
pass recomputes the row quantities from the inputs instead of saving D-sized
intermediates, so the update costs no activation memory beyond its inputs.

One update is three kernel launches and nothing else: the forward kernel, the
backward kernel, and a one-program kernel that sums the backward's per-program
partials of the gate parameter gradients. Every program computes the gate's
parameter transforms (softmax of coef, softplus of beta_raw, α times its
warm-up factor) in registers from the raw parameters, so no small eager op
runs around the kernels (scripts/bench/nag.py --sections launches counts them).

Both passes are torch.library custom ops (nag::fused_branch and
nag::fused_branch_backward) tied together with register_autograd, so a
torch.compile'd model treats the update as one opaque node without a graph
break. We use custom_op rather than triton_op: triton_op traces its body with
fake tensors, which cannot work for kernels running in Triton's interpreter,
and Inductor could not fuse this kernel with its neighbours anyway.

Computation is in fp32 inside the kernels whatever the input dtype; outputs
and gradients come back in the dtype of the matching input.
Shapes follow nag.functional: rows (..., D), log_norm (..., 1), mod_logits
(..., C), coef (C,), beta_raw (1,), alpha (1,), alpha_scale (1,) or None;
leading dims are flattened.
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
    raise ImportError(
        "Triton was imported before nag on a machine without a GPU, so its interpreter cannot run "
        "the fused kernels: import nag before torch._functorch, torch._inductor or triton"
    )

# -----------------------------------------------------------------------------
# Gate and row math shared by the kernels


@triton.jit
def _log1p(x):
    # log(1 + x) would lose x below fp32 epsilon (tiny gains at the floor);
    # Goldberg's correction keeps it exact to rounding
    w = 1.0 + x
    small = w == 1.0
    return tl.where(small, x, tl.log(w) * (x / tl.where(small, 1.0, w - 1.0)))


@triton.jit
def _gate_params(coef_ptr, beta_raw_ptr, alpha_ptr, scale_ptr, C, BLOCK_C: tl.constexpr, HAS_SCALE: tl.constexpr):
    """The gate's parameter transforms, recomputed by every program (C is small): returns
    (softmax(coef), softplus(beta_raw), α × alpha_scale)."""
    cols = tl.arange(0, BLOCK_C)
    coef = tl.load(coef_ptr + cols, mask=cols < C, other=-float("inf")).to(tl.float32)
    e = tl.exp(coef - tl.max(coef, axis=0))  # 0 on padding: no effect on u
    weights = e / tl.sum(e, axis=0)
    beta_raw = tl.load(beta_raw_ptr).to(tl.float32)
    # torch's softplus: the identity above 20, where log1p(e^x) = x in fp32
    beta = tl.where(beta_raw > 20.0, beta_raw, _log1p(tl.exp(tl.minimum(beta_raw, 20.0))))
    alpha = tl.load(alpha_ptr).to(tl.float32)
    if HAS_SCALE:
        alpha = alpha * tl.load(scale_ptr).to(tl.float32)
    return weights, beta, alpha


@triton.jit
def _gate(logits_ptr, weights, beta, alpha, row, floor, C, BLOCK_C: tl.constexpr):
    """Modulator and gain of one row: returns (sigmoids, u, clamped u, m, g)."""
    cols = tl.arange(0, BLOCK_C)
    z = tl.load(logits_ptr + row * C + cols, mask=cols < C, other=0.0).to(tl.float32)
    sig = tl.sigmoid(z)
    u = tl.sum(weights * sig, axis=0)
    u_clamped = tl.maximum(u, floor)
    m = tl.exp2(beta * tl.log2(u_clamped))  # u_clamped ** beta, and 0 ** beta = 0
    return sig, u, u_clamped, m, alpha * m


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
# Kernels: forward one program per row, backward one per run of rows, then one for the gate


@triton.jit
def _nag_forward_kernel(
    res_ptr,
    log_norm_ptr,
    branch_ptr,
    logits_ptr,
    coef_ptr,
    beta_raw_ptr,
    alpha_ptr,
    scale_ptr,
    new_res_ptr,
    new_log_norm_ptr,
    floor,
    D,
    C,
    sqrt_d,
    BLOCK_D: tl.constexpr,
    BLOCK_C: tl.constexpr,
    PREDICTED: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    ORTHO_EPS: tl.constexpr,
    RMS_EPS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    weights, beta, alpha = _gate_params(coef_ptr, beta_raw_ptr, alpha_ptr, scale_ptr, C, BLOCK_C, HAS_SCALE)
    _, _, _, _, g = _gate(logits_ptr, weights, beta, alpha, row, floor, C, BLOCK_C)
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
    res_ptr,
    branch_ptr,
    logits_ptr,
    coef_ptr,
    beta_raw_ptr,
    alpha_ptr,
    scale_ptr,
    grad_new_res_ptr,
    grad_new_log_norm_ptr,
    grad_res_ptr,
    grad_branch_ptr,
    grad_logits_ptr,
    part_weights_ptr,
    part_scalars_ptr,
    floor,
    n_rows,
    D,
    C,
    sqrt_d,
    ROWS_PER_PROGRAM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_C: tl.constexpr,
    PREDICTED: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    ORTHO_EPS: tl.constexpr,
    RMS_EPS: tl.constexpr,
):
    program = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    c_cols = tl.arange(0, BLOCK_C)
    c_mask = c_cols < C
    weights, beta, alpha = _gate_params(coef_ptr, beta_raw_ptr, alpha_ptr, scale_ptr, C, BLOCK_C, HAS_SCALE)
    # this program's sums of the gate parameter gradients over its rows, in a fixed order: deterministic
    acc_weights = tl.zeros([BLOCK_C], dtype=tl.float32)
    acc_scalars = tl.zeros([2], dtype=tl.float32)  # (β, α)
    for i in range(ROWS_PER_PROGRAM):
        # past the last row, redo the last row (valid memory, finite values) and keep nothing of it
        valid = program * ROWS_PER_PROGRAM + i < n_rows
        row = tl.minimum(program * ROWS_PER_PROGRAM + i, n_rows - 1).to(tl.int64)
        stored = cols < tl.where(valid, D, 0)  # the row's columns, none on a redone row
        # recompute the forward row
        sig, u, u_clamped, m, g = _gate(logits_ptr, weights, beta, alpha, row, floor, C, BLOCK_C)
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
        tl.store(grad_res_ptr + row * D + cols, grad_res.to(grad_res_ptr.dtype.element_ty), mask=stored)
        tl.store(grad_branch_ptr + row * D + cols, grad_x.to(grad_branch_ptr.dtype.element_ty), mask=stored)

        # gate: g = α·m, m = max(u, floor)^β, u = Σ w_i σ(z_i)
        grad_alpha = grad_g * m
        grad_m = grad_g * alpha
        # like torch.pow, the exponent's gradient is 0 where the base is 0
        log_u = tl.log(tl.where(u_clamped > 0.0, u_clamped, 1.0))
        grad_beta = grad_m * m * log_u
        # β·u^(β−1) is inf at u == 0 for β < 1: kept, this is failure 1 with floor 0
        power = tl.where(beta == 1.0, 1.0, tl.exp2((beta - 1.0) * tl.log2(u_clamped)))
        # clamp passes the gradient where u ≥ floor, like torch.clamp
        grad_u = tl.where(u >= floor, grad_m * beta * power, 0.0)
        grad_z = grad_u * weights * sig * (1.0 - sig)
        tl.store(
            grad_logits_ptr + row * C + c_cols,
            grad_z.to(grad_logits_ptr.dtype.element_ty),
            mask=c_cols < tl.where(valid, C, 0),
        )
        # tl.where, not a product: a non-finite gradient (failure 1) must reach the sums, and a redone row must not
        acc_weights += tl.where(valid, grad_u * sig, 0.0)
        acc_scalars += tl.where(valid, tl.where(tl.arange(0, 2) == 0, grad_beta, grad_alpha), 0.0)
    tl.store(part_weights_ptr + program * C + c_cols, acc_weights, mask=c_mask)
    tl.store(part_scalars_ptr + program * 2 + tl.arange(0, 2), acc_scalars)


@triton.jit
def _nag_gate_grad_kernel(
    part_weights_ptr,
    part_scalars_ptr,
    coef_ptr,
    beta_raw_ptr,
    alpha_ptr,
    scale_ptr,
    grad_coef_ptr,
    grad_beta_raw_ptr,
    grad_alpha_ptr,
    n_parts,
    C,
    BLOCK_P: tl.constexpr,
    BLOCK_C: tl.constexpr,
    HAS_SCALE: tl.constexpr,
):
    """One program: sums the backward's partials, then chains through softmax(coef), softplus(beta_raw)
    and the α scale."""
    c_cols = tl.arange(0, BLOCK_C)
    c_mask = c_cols < C
    s_cols = tl.arange(0, 2)
    grad_weights = tl.zeros([BLOCK_C], dtype=tl.float32)
    grad_scalars = tl.zeros([2], dtype=tl.float32)  # (β, α)
    for start in range(0, n_parts, BLOCK_P):
        parts = start + tl.arange(0, BLOCK_P)
        p_mask = parts < n_parts
        w = tl.load(
            part_weights_ptr + parts[:, None] * C + c_cols[None, :], mask=p_mask[:, None] & c_mask[None, :], other=0.0
        )
        grad_weights += tl.sum(w, axis=0)
        sc = tl.load(part_scalars_ptr + parts[:, None] * 2 + s_cols[None, :], mask=p_mask[:, None], other=0.0)
        grad_scalars += tl.sum(sc, axis=0)
    weights, _, _ = _gate_params(coef_ptr, beta_raw_ptr, alpha_ptr, scale_ptr, C, BLOCK_C, HAS_SCALE)
    grad_coef = weights * (grad_weights - tl.sum(weights * grad_weights, axis=0))
    tl.store(grad_coef_ptr + c_cols, grad_coef.to(grad_coef_ptr.dtype.element_ty), mask=c_mask)
    # softplus' = sigmoid; α's gradient is the effective α's times the scale
    beta_raw = tl.load(beta_raw_ptr).to(tl.float32)
    factor = tl.where(s_cols == 0, tl.sigmoid(beta_raw), 1.0)
    if HAS_SCALE:
        factor = tl.where(s_cols == 1, tl.load(scale_ptr).to(tl.float32), factor)
    grad_scalars = grad_scalars * factor
    tl.store(grad_beta_raw_ptr + s_cols, grad_scalars.to(grad_beta_raw_ptr.dtype.element_ty), mask=s_cols == 0)
    tl.store(grad_alpha_ptr + s_cols - 1, grad_scalars.to(grad_alpha_ptr.dtype.element_ty), mask=s_cols == 1)


# -----------------------------------------------------------------------------
# Launch helpers


def _rows(t, width):
    return t.reshape(-1, width).contiguous()


def _launch_config(dim, channels):
    block_d = triton.next_power_of_2(dim)
    block_c = triton.next_power_of_2(channels)
    num_warps = min(max(block_d // 256, 1), 16)
    return block_d, block_c, num_warps


# the backward's programs each take a run of up to this many rows, so that its partial sums stay a few thousand
# rows of C + 2 floats for the one-program gate kernel; a guess, not yet tuned on a GPU (the branch-op bench,
# scripts/bench/nag.py --sections op --op-rows-per-program 1,2,4,8,16,32, measures each value)
BACKWARD_ROWS_PER_PROGRAM = 16


def _rows_per_program(rows):
    # below 2,048 × the default rows, fewer per program: some 2,048 programs still fill the SMs
    return max(1, min(BACKWARD_ROWS_PER_PROGRAM, rows // 2048))


# -----------------------------------------------------------------------------
# Custom ops


@torch.library.custom_op("nag::fused_branch", mutates_args=())
def _fused_branch(
    res_dir: torch.Tensor,
    log_norm: torch.Tensor,
    branch_out: torch.Tensor,
    mod_logits: torch.Tensor,
    coef: torch.Tensor,
    beta_raw: torch.Tensor,
    alpha: torch.Tensor,
    alpha_scale: torch.Tensor | None,
    floor: float,
    renorm: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    check_renorm(renorm)
    dim, channels = res_dir.size(-1), mod_logits.size(-1)
    res = _rows(res_dir, dim)
    rows = res.size(0)
    log_norm_rows = _rows(log_norm, 1)
    branch = _rows(branch_out, dim)
    logits = _rows(mod_logits, channels)
    new_res = torch.empty_like(res)
    new_log_norm = torch.empty_like(log_norm_rows)
    block_d, block_c, num_warps = _launch_config(dim, channels)
    if rows > 0:
        _nag_forward_kernel[(rows,)](
            res,
            log_norm_rows,
            branch,
            logits,
            coef.contiguous(),
            beta_raw,
            alpha,
            alpha if alpha_scale is None else alpha_scale,  # not read without a scale
            new_res,
            new_log_norm,
            float(floor),
            dim,
            channels,
            math.sqrt(dim),
            BLOCK_D=block_d,
            BLOCK_C=block_c,
            PREDICTED=renorm == "predicted",
            HAS_SCALE=alpha_scale is not None,
            ORTHO_EPS=ORTHO_EPS,
            RMS_EPS=RMS_EPS,
            num_warps=num_warps,
        )
    return new_res.view(res_dir.shape), new_log_norm.view(log_norm.shape)


def _fresh(t):
    # what the real ops allocate: t's shape, dtype and device, contiguous whatever t's strides
    # (empty_like alone keeps a dense input's strides, a transposed one's included)
    return torch.empty_like(t, memory_format=torch.contiguous_format)


@_fused_branch.register_fake
def _(res_dir, log_norm, branch_out, mod_logits, coef, beta_raw, alpha, alpha_scale, floor, renorm):
    return _fresh(res_dir), _fresh(log_norm)


@torch.library.custom_op("nag::fused_branch_backward", mutates_args=())
def _fused_branch_backward(
    grad_new_dir: torch.Tensor,
    grad_new_log_norm: torch.Tensor,
    res_dir: torch.Tensor,
    branch_out: torch.Tensor,
    mod_logits: torch.Tensor,
    coef: torch.Tensor,
    beta_raw: torch.Tensor,
    alpha: torch.Tensor,
    alpha_scale: torch.Tensor | None,
    floor: float,
    renorm: str,
    rows_per_program: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns the gradients of (res_dir, branch_out, mod_logits, coef, beta_raw, alpha). rows_per_program: the
    rows each backward program takes (a compile each), 0 for _rows_per_program's choice; the gradients do not depend
    on it, but for the parameter gradients' rounding (their partial sums are grouped by program)."""
    check_renorm(renorm)
    dim, channels = res_dir.size(-1), mod_logits.size(-1)
    res = _rows(res_dir, dim)
    rows = res.size(0)
    branch = _rows(branch_out, dim)
    logits = _rows(mod_logits, channels)
    grad_new_res = _rows(grad_new_dir, dim)
    grad_new_log_norm = _rows(grad_new_log_norm, 1)
    coef_ = coef.contiguous()
    scale = alpha if alpha_scale is None else alpha_scale  # not read without a scale
    grad_res = torch.empty_like(res)
    grad_branch = torch.empty_like(branch)
    grad_logits = torch.empty_like(logits)
    grad_coef, grad_beta_raw, grad_alpha = _fresh(coef), _fresh(beta_raw), _fresh(alpha)
    # per-program partials of the parameter gradients, summed by the gate kernel: deterministic, no atomics
    per_program = rows_per_program or _rows_per_program(rows)
    programs = triton.cdiv(rows, per_program)
    part_weights = torch.empty(programs, channels, dtype=torch.float32, device=res.device)
    part_scalars = torch.empty(programs, 2, dtype=torch.float32, device=res.device)
    block_d, block_c, num_warps = _launch_config(dim, channels)
    if rows > 0:
        _nag_backward_kernel[(programs,)](
            res,
            branch,
            logits,
            coef_,
            beta_raw,
            alpha,
            scale,
            grad_new_res,
            grad_new_log_norm,
            grad_res,
            grad_branch,
            grad_logits,
            part_weights,
            part_scalars,
            float(floor),
            rows,
            dim,
            channels,
            math.sqrt(dim),
            ROWS_PER_PROGRAM=per_program,
            BLOCK_D=block_d,
            BLOCK_C=block_c,
            PREDICTED=renorm == "predicted",
            HAS_SCALE=alpha_scale is not None,
            ORTHO_EPS=ORTHO_EPS,
            RMS_EPS=RMS_EPS,
            num_warps=num_warps,
        )
    # with no rows it still runs: the parameter gradients are then 0
    _nag_gate_grad_kernel[(1,)](
        part_weights,
        part_scalars,
        coef_,
        beta_raw,
        alpha,
        scale,
        grad_coef,
        grad_beta_raw,
        grad_alpha,
        programs,
        channels,
        BLOCK_P=max(16, 2048 // block_c),
        BLOCK_C=block_c,
        HAS_SCALE=alpha_scale is not None,
        num_warps=4,
    )
    return (
        grad_res.view(res_dir.shape),
        grad_branch.view(branch_out.shape),
        grad_logits.view(mod_logits.shape),
        grad_coef,
        grad_beta_raw,
        grad_alpha,
    )


@_fused_branch_backward.register_fake
def _(
    grad_new_dir,
    grad_new_log_norm,
    res_dir,
    branch_out,
    mod_logits,
    coef,
    beta_raw,
    alpha,
    alpha_scale,
    floor,
    renorm,
    rows_per_program=0,
):
    # each gradient in its input's dtype and shape (the parameter ones are reduced in fp32, then cast)
    return _fresh(res_dir), _fresh(branch_out), _fresh(mod_logits), _fresh(coef), _fresh(beta_raw), _fresh(alpha)


def _setup_context(ctx, inputs, output):
    res_dir, log_norm, branch_out, mod_logits, coef, beta_raw, alpha, alpha_scale, floor, renorm = inputs
    # inputs only: the backward kernel recomputes every row quantity
    ctx.save_for_backward(res_dir, branch_out, mod_logits, coef, beta_raw, alpha, alpha_scale)
    ctx.floor, ctx.renorm = floor, renorm


def _backward(ctx, grad_new_dir, grad_new_log_norm):
    res_dir, branch_out, mod_logits, coef, beta_raw, alpha, alpha_scale = ctx.saved_tensors
    grad_res, grad_branch, grad_logits, grad_coef, grad_beta_raw, grad_alpha = _fused_branch_backward(
        grad_new_dir,
        grad_new_log_norm,
        res_dir,
        branch_out,
        mod_logits,
        coef,
        beta_raw,
        alpha,
        alpha_scale,
        ctx.floor,
        ctx.renorm,
    )
    # new_log_norm = log_norm + f(g), so log_norm's gradient passes straight through; alpha_scale is a
    # constant (the warm-up factor): no gradient
    return (
        grad_res,
        grad_new_log_norm,
        grad_branch,
        grad_logits,
        grad_coef,
        grad_beta_raw,
        grad_alpha,
        None,
        None,
        None,
    )


_fused_branch.register_autograd(_backward, setup_context=_setup_context)


def fused_nag_branch(
    res_dir, log_norm, branch_out, mod_logits, coef, beta_raw, alpha, floor, renorm="measured", alpha_scale=None
):
    """Fused nag.functional.nag_branch: returns (new_dir, new_log_norm), log_norm shaped (..., 1)."""
    check_renorm(renorm)  # raise here, not deep inside a compiled graph
    return _fused_branch(
        res_dir, log_norm, branch_out, mod_logits, coef, beta_raw, alpha, alpha_scale, float(floor), renorm
    )
