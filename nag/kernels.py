"""
Fused Triton kernels for one NAG residual update (docs/design.md §4).

fused_nag_branch has the signature and results of nag.functional.nag_branch,
but does one pass over each token row: modulator, gain, centring,
orthogonalisation, N_out, update, renorm and log-norm update. The backward
pass recomputes the row quantities from the inputs instead of saving D-sized
intermediates, so the update costs no activation memory beyond its inputs.

One update is three kernel launches and nothing else: the forward kernel, the
backward kernel, and a one-program kernel that sums the backward's per-program
partials of the gate parameter gradients. Both row kernels work on tiles of
BLOCK_R rows × BLOCK_D columns: each program computes the gate's parameter
transforms (softmax of coef, softplus of beta_raw, α times its warm-up factor)
once, in registers, from the raw parameters, so no small eager op runs around
the kernels (scripts/bench/nag.py --sections launches counts them), and each
row's sums are grouped into a few multi-operand reductions (3 rounds forward,
4 backward), each shared by the tile's rows.

Both passes are torch.library custom ops (nag::fused_branch and
nag::fused_branch_backward) tied together with register_autograd, so a
torch.compile'd model treats the update as one opaque node without a graph
break. We keep custom_op rather than triton_op + wrap_triton: in torch 2.13
under TRITON_INTERPRET=1, dynamo runs a triton_op's body on fake tensors and the
interpreter then fails ("Cannot access data pointer of Tensor (e.g.
FakeTensor, FunctionalTensor)"), so no CPU test could compile the model.

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
def _row_sums2(a, b):
    """(Σa, Σb) along the rows of two [BLOCK_R, BLOCK_D] tiles as one reduction: a single exchange between warps
    for both. (Joined, not a multi-operand tl.reduce, which the interpreter runs element by element.)"""
    return tl.split(tl.sum(tl.join(a, b), axis=1))


@triton.jit
def _row_sums4(a, b, c, d):
    """(Σa, Σb, Σc, Σd) along the rows of four tiles as one reduction, like _row_sums2."""
    ab, cd = tl.split(tl.sum(tl.join(tl.join(a, b), tl.join(c, d)), axis=1))
    sum_a, sum_b = tl.split(ab)
    sum_c, sum_d = tl.split(cd)
    return sum_a, sum_b, sum_c, sum_d


@triton.jit
def _gate_params(coef_ptr, beta_raw_ptr, alpha_ptr, scale_ptr, C, BLOCK_C: tl.constexpr, HAS_SCALE: tl.constexpr):
    """The gate's parameter transforms, computed once per program (C is small): returns
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
def _gate(z, weights, beta, alpha, floor):
    """Modulator and gain of a tile's rows from their logits z [BLOCK_R, BLOCK_C] in fp32:
    returns (sigmoids, u, clamped u, m, g), the last four one value a row."""
    sig = tl.sigmoid(z)
    u = tl.sum(weights[None, :] * sig, axis=1)
    u_clamped = tl.maximum(u, floor)
    m = tl.exp2(beta * tl.log2(u_clamped))  # u_clamped ** beta, and 0 ** beta = 0
    return sig, u, u_clamped, m, alpha * m


@triton.jit
def _project(res, x, col_mask, D):
    """The centred branch output without its component along R̄, for a tile [BLOCK_R, BLOCK_D] (zeros past D):
    returns (x_⊥, along, ⟨R̄,R̄⟩, ΣR̄). One reduction round: ⟨x_c,R̄⟩ = ⟨x,R̄⟩ − mean(x)·ΣR̄."""
    sum_x, sum_res, res_sq, x_res = _row_sums4(x, res, res * res, x * res)
    mean = sum_x / D
    along = (x_res - mean * sum_res) / res_sq
    x_perp = tl.where(col_mask, x - mean[:, None] - along[:, None] * res, 0.0)
    return x_perp, along, res_sq, sum_res


# -----------------------------------------------------------------------------
# Kernels: forward one tile per program, backward a run of tiles per program, then one program for the gate


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
    n_rows,
    D,
    C,
    sqrt_d,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_C: tl.constexpr,
    PREDICTED: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    ORTHO_EPS: tl.constexpr,
    RMS_EPS: tl.constexpr,
):
    first = tl.program_id(0).to(tl.int64) * BLOCK_R
    rows_in = first + tl.arange(0, BLOCK_R)
    valid = rows_in < n_rows
    # past the last row, redo the last row (valid memory, finite values) and store nothing of it
    rows = tl.minimum(rows_in, n_rows - 1)
    cols = tl.arange(0, BLOCK_D)
    col_mask = cols[None, :] < D
    c_cols = tl.arange(0, BLOCK_C)
    offsets = rows[:, None] * D + cols[None, :]
    # every load first, so that they are all in flight together
    res = tl.load(res_ptr + offsets, mask=col_mask, other=0.0).to(tl.float32)
    x = tl.load(branch_ptr + offsets, mask=col_mask, other=0.0).to(tl.float32)
    z = tl.load(logits_ptr + rows[:, None] * C + c_cols[None, :], mask=c_cols[None, :] < C, other=0.0)
    log_norm = tl.load(log_norm_ptr + rows).to(tl.float32)
    weights, beta, alpha = _gate_params(coef_ptr, beta_raw_ptr, alpha_ptr, scale_ptr, C, BLOCK_C, HAS_SCALE)
    _, _, _, _, g = _gate(z.to(tl.float32), weights, beta, alpha, floor)
    x_perp, _, _, _ = _project(res, x, col_mask, D)
    inv_norm = tl.rsqrt(tl.sum(x_perp * x_perp, axis=1) + ORTHO_EPS)
    y = res + (g * sqrt_d * inv_norm)[:, None] * x_perp
    if PREDICTED:
        new_res = y * tl.rsqrt(1.0 + g * g)[:, None]
    else:
        new_res = y * tl.rsqrt(tl.sum(y * y, axis=1) / D + RMS_EPS)[:, None]
    tl.store(new_res_ptr + offsets, new_res.to(new_res_ptr.dtype.element_ty), mask=col_mask & valid[:, None])
    new_log_norm = log_norm + 0.5 * _log1p(g * g)
    tl.store(new_log_norm_ptr + rows, new_log_norm.to(new_log_norm_ptr.dtype.element_ty), mask=valid)


@triton.jit
def _load_tile(
    res_ptr,
    branch_ptr,
    logits_ptr,
    grad_new_res_ptr,
    grad_new_log_norm_ptr,
    rows,
    D,
    C,
    BLOCK_D: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """The backward's inputs of a tile of rows, in fp32."""
    cols = tl.arange(0, BLOCK_D)
    c_cols = tl.arange(0, BLOCK_C)
    offsets = rows[:, None] * D + cols[None, :]
    mask = cols[None, :] < D
    res = tl.load(res_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(branch_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    grad_new_res = tl.load(grad_new_res_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(logits_ptr + rows[:, None] * C + c_cols[None, :], mask=c_cols[None, :] < C, other=0.0)
    grad_new_log_norm = tl.load(grad_new_log_norm_ptr + rows).to(tl.float32)
    return res, x, grad_new_res, z.to(tl.float32), grad_new_log_norm


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
    TILES: tl.constexpr,
    STAGES: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_C: tl.constexpr,
    PREDICTED: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    ORTHO_EPS: tl.constexpr,
    RMS_EPS: tl.constexpr,
):
    program = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    col_mask = cols[None, :] < D
    c_cols = tl.arange(0, BLOCK_C)
    c_mask = c_cols < C
    weights, beta, alpha = _gate_params(coef_ptr, beta_raw_ptr, alpha_ptr, scale_ptr, C, BLOCK_C, HAS_SCALE)
    # this program's terms of the gate parameter gradients, a row each, summed in a fixed order: deterministic
    acc_weights = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    acc_beta = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc_alpha = tl.zeros([BLOCK_R], dtype=tl.float32)
    first = program.to(tl.int64) * (TILES * BLOCK_R)
    # num_stages: Triton's pipeliner copies the next tiles' rows into shared memory (cp.async) while this one is
    # computed, so a program keeps loads in flight without registers to hold them
    for t in tl.range(TILES, num_stages=STAGES):
        rows_in = first + t * BLOCK_R + tl.arange(0, BLOCK_R)
        # past the last row, redo the last row (valid memory, finite values) and keep nothing of it
        valid = rows_in < n_rows
        rows = tl.minimum(rows_in, n_rows - 1)
        stored = col_mask & valid[:, None]
        res, x, grad_new_res, z, grad_new_log_norm = _load_tile(
            res_ptr, branch_ptr, logits_ptr, grad_new_res_ptr, grad_new_log_norm_ptr, rows, D, C, BLOCK_D, BLOCK_C
        )

        # recompute the forward rows (round 1: _project; round 2: x_⊥'s sums)
        sig, u, u_clamped, m, g = _gate(z, weights, beta, alpha, floor)
        x_perp, along, res_sq, sum_res = _project(res, x, col_mask, D)
        perp_sq, perp_sum, perp_res, _ = _row_sums4(x_perp * x_perp, x_perp, x_perp * res, tl.zeros_like(res))
        inv_norm = tl.rsqrt(perp_sq + ORTHO_EPS)
        k = sqrt_d * inv_norm  # o = k·x_⊥
        y = res + (g * k)[:, None] * x_perp

        grad_g = grad_new_log_norm * g / (1.0 + g * g)
        # renorm (round 3). Both modes reduce the same pair: a lone tl.sum here built with 170 registers on sm_90
        # instead of 110, which halves the programs an SM holds
        y_sq, y_grad = _row_sums2(y * y, y * grad_new_res)
        if PREDICTED:
            scale = tl.rsqrt(1.0 + g * g)
            grad_y = scale[:, None] * grad_new_res
            grad_g -= g * scale * scale * scale * y_grad
        else:
            scale = tl.rsqrt(y_sq / D + RMS_EPS)
            # new_res = scale·y, so ⟨new_res, grad⟩ = scale·⟨y, grad⟩
            grad_y = scale[:, None] * (grad_new_res - (scale * scale * y_grad / D)[:, None] * y)
        # y = R̄ + g·o, o = k·x_⊥ (round 4: every later sum is linear in these three)
        gy_perp, gy_res, gy_sum, _ = _row_sums4(grad_y * x_perp, grad_y * res, grad_y, tl.zeros_like(res))
        grad_g += k * gy_perp
        # o = √D · x_⊥ / ‖x_⊥‖ with grad_o = g·grad_y: grad_⊥ = k·(g·grad_y − x_⊥·⟨x_⊥,grad_o⟩/‖x_⊥‖²)
        c = inv_norm * inv_norm * g * gy_perp
        grad_perp = k[:, None] * (g[:, None] * grad_y - c[:, None] * x_perp)
        # x_⊥ = x_c − along·R̄, along = ⟨x_c,R̄⟩/⟨R̄,R̄⟩
        grad_along = -k * (g * gy_res - c * perp_res)  # −⟨grad_⊥, R̄⟩
        a = grad_along / res_sq
        grad_res = grad_y - along[:, None] * grad_perp + a[:, None] * (x_perp - along[:, None] * res)
        # x_c = x − mean(x): less the mean of grad_⊥ + a·R̄
        mean_grad = (k * (g * gy_sum - c * perp_sum) + a * sum_res) / D
        grad_x = grad_perp + a[:, None] * res - mean_grad[:, None]
        offsets = rows[:, None] * D + cols[None, :]
        tl.store(grad_res_ptr + offsets, grad_res.to(grad_res_ptr.dtype.element_ty), mask=stored)
        tl.store(grad_branch_ptr + offsets, grad_x.to(grad_branch_ptr.dtype.element_ty), mask=stored)

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
        grad_z = grad_u[:, None] * weights[None, :] * sig * (1.0 - sig)
        tl.store(
            grad_logits_ptr + rows[:, None] * C + c_cols[None, :],
            grad_z.to(grad_logits_ptr.dtype.element_ty),
            mask=c_mask[None, :] & valid[:, None],
        )
        # tl.where, not a product: a non-finite gradient (failure 1) must reach the sums, and a redone row must not
        acc_weights += tl.where(valid[:, None], grad_u[:, None] * sig, 0.0)
        acc_beta += tl.where(valid, grad_beta, 0.0)
        acc_alpha += tl.where(valid, grad_alpha, 0.0)
    tl.store(part_weights_ptr + program * C + c_cols, tl.sum(acc_weights, axis=0), mask=c_mask)
    s_cols = tl.arange(0, 2)
    scalars = tl.where(s_cols == 0, tl.sum(acc_beta, axis=0), tl.sum(acc_alpha, axis=0))  # (β, α)
    tl.store(part_scalars_ptr + program * 2 + s_cols, scalars)


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


# Elements of one D-sized row vector each thread holds, in fp32 registers. The backward keeps about a dozen such
# vectors live (8 build with 108-128 registers on sm_90, no spills: 2 programs an SM), the forward about four (16
# build with 64-80: 3-4 programs an SM); `python -m scripts.bench.kernel_report` shows the builds
FORWARD_PER_THREAD, BACKWARD_PER_THREAD = 16, 8
# 8 warps: a row of up to 1,024 columns spans 4 of them in bf16 (128-bit accesses: 8 columns a lane), 8 in fp32, so
# a tile holds 2 rows or more, and each reduction round's exchange between warps serves them all
NUM_WARPS = 8


def _launch_config(dim, channels, per_thread):
    """(BLOCK_R, BLOCK_D, BLOCK_C, num_warps) of a row kernel: D padded to a power of two, and as many rows a tile as
    give each thread per_thread elements of a row vector (more warps instead past 2,048 columns)."""
    # The padding (at D = 640: BLOCK_D 1,024, 37.5 % of the lanes idle) moves no byte: the masked columns are
    # neither read nor written, and the sm_90 builds move the least bytes a row can (3,912 forward, 6,532 backward
    # in bf16). What it costs is registers and issue slots; the builds still hold 41 KB (forward) and 46 KB
    # (backward) of loads in flight per SM, above the ~36 KB an H200 needs to cover its memory latency. No
    # padding at 640 = 512 + 128 would need two tiles a row, and 8 warps over a 128-wide tile read 16-bit
    # elements unless it held 16 rows: 32 elements a thread of the 512-wide one, past the backward's registers.
    block_d = triton.next_power_of_2(dim)
    block_c = triton.next_power_of_2(channels)
    num_warps = min(16, max(NUM_WARPS, block_d // (32 * per_thread)))
    block_r = max(1, per_thread * 32 * num_warps // block_d)
    return block_r, block_d, block_c, num_warps


# the backward's programs each take a run of up to this many rows, so that its partial sums stay a few thousand
# rows of C + 2 floats for the one-program gate kernel; a guess, not yet tuned on a GPU (the branch-op bench,
# scripts/bench/nag.py --sections op --op-rows-per-program 1,2,4,8,16,32, measures each value)
BACKWARD_ROWS_PER_PROGRAM = 16
# the backward's pipeline depth: its program has the next STAGES − 1 tiles' loads in flight (in shared memory) while it
# computes one, so that 2 programs an SM (the registers allow no more) keep 46 KB in flight at D = 640 in bf16
BACKWARD_STAGES = 4


def _rows_per_program(rows):
    # below 2,048 × the default rows, fewer per program: some 2,048 programs still fill the SMs
    return max(1, min(BACKWARD_ROWS_PER_PROGRAM, rows // 2048))


def _gate_grad_config(channels):
    """(BLOCK_P, BLOCK_C, num_warps) of the one-program gate kernel: partials read some 2,048 floats at a time."""
    block_c = triton.next_power_of_2(channels)
    return max(16, 2048 // block_c), block_c, 4


def _backward_tiles(rows_per_program, block_r):
    """(BLOCK_R, TILES) of a backward program taking rows_per_program rows: tiles of at most block_r rows, a power
    of two, and as many as cover the rows (a program covers TILES × BLOCK_R rows)."""
    block_r = min(block_r, 1 << (rows_per_program.bit_length() - 1))
    return block_r, triton.cdiv(rows_per_program, block_r)


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
    block_r, block_d, block_c, num_warps = _launch_config(dim, channels, FORWARD_PER_THREAD)
    if rows > 0:
        _nag_forward_kernel[(triton.cdiv(rows, block_r),)](
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
            rows,
            dim,
            channels,
            math.sqrt(dim),
            BLOCK_R=block_r,
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
    rows each backward program takes (a compile each; rounded up to whole tiles by _backward_tiles), 0 for
    _rows_per_program's choice; the gradients do not depend on it, but for the parameter gradients' rounding (their
    partial sums are grouped by program and tile)."""
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
    block_r, block_d, block_c, num_warps = _launch_config(dim, channels, BACKWARD_PER_THREAD)
    block_r, tiles = _backward_tiles(rows_per_program or _rows_per_program(rows), block_r)
    programs = triton.cdiv(rows, block_r * tiles)
    part_weights = torch.empty(programs, channels, dtype=torch.float32, device=res.device)
    part_scalars = torch.empty(programs, 2, dtype=torch.float32, device=res.device)
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
            TILES=tiles,
            STAGES=BACKWARD_STAGES,
            BLOCK_R=block_r,
            BLOCK_D=block_d,
            BLOCK_C=block_c,
            PREDICTED=renorm == "predicted",
            HAS_SCALE=alpha_scale is not None,
            ORTHO_EPS=ORTHO_EPS,
            RMS_EPS=RMS_EPS,
            num_warps=num_warps,
        )
    # with no rows it still runs: the parameter gradients are then 0
    block_p, block_c, gate_warps = _gate_grad_config(channels)
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
        BLOCK_P=block_p,
        BLOCK_C=block_c,
        HAS_SCALE=alpha_scale is not None,
        num_warps=gate_warps,
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
