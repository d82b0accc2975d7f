"""
fp8 training of the linear layers: tensorwise dynamic scaling around torch._scaled_mm.

docs/design.md §2, "fp8", explains the design.

    model.set_fp8(True)    # base_train --fp8: every Linear the size rule admits runs its three matmuls in fp8
    fp8_linear(x, weight)  # x @ weight.T; forward and backward each quantise their operands on the fly

A linear layer makes three matmuls per step: y = x·Wᵀ forward, and dx = dy·W, dW = dyᵀ·x backward. Each operand
is scaled by one number (the tensor's largest |value| mapped to the format's largest finite value), cast to fp8, and
the scaled matmul multiplies the inverse scales back in. Inputs and weights use float8_e4m3fn (3 mantissa bits,
range ±448), gradients float8_e5m2 (2 mantissa bits, range ±57,344: gradients span more decades). The fp32 master
weights and the optimizer are untouched; only the matmuls change. Facts from nanochat's nanochat/fp8.py (tensorwise
scaling, e4m3 / e5m2, fast accumulation in the forward only, dims in multiples of 16); the code is this project's.

Only training runs in fp8 (the layer's `training` flag): evaluation, sampling and export stay in the compute dtype,
as nanochat evaluates. FLOPs and MFU are counted as for bf16 (its peak), so an fp8 run's MFU shows its speed-up.
"""

import functools
import os

import torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
MIN_DIM = 128  # a smaller matmul gains less from fp8 than its scaling passes cost (gates and routers of a few channels)
MULTIPLE = 16  # CUDA _scaled_mm's rule for the inner dim and the second operand's (admits; pad_rows for the tokens)
MIN_CAPABILITY = (8, 9)  # CUDA: fp8 tensor cores from Ada and Hopper on


def admits(in_features, out_features):
    """The size rule: which Linear layers run in fp8 (the others stay in the compute dtype)."""
    return all(d >= MIN_DIM and d % MULTIPLE == 0 for d in (in_features, out_features))


def cannot_run(device):
    """Why fp8 training cannot run on `device`, or None. The CPU runs _scaled_mm too (slowly): the twin of the tests,
    where its kernel has an fp8 matmul (cpu_cannot_run)."""
    device = torch.device(device)
    if device.type == "cpu":
        return cpu_cannot_run()
    if device.type != "cuda":
        return f"device {device.type} has no fp8 matmul"
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        return (
            f"compute capability {capability[0]}.{capability[1]} has no fp8 tensor cores "
            "(needs 8.9: Ada, Hopper or newer)"
        )
    return None


@functools.cache
def cpu_cannot_run():
    """Why this CPU's _scaled_mm fails, or None; probed once per process with one small fp8 layer, forward and
    backward. torch hands fp8 matmuls to oneDNN on a CPU with AMX (elsewhere it emulates them in fp32), and oneDNN
    builds them only from AVX512-FP16 on: capped below that (ONEDNN_MAX_CPU_ISA), it has none."""
    x, w = torch.ones(MULTIPLE, MIN_DIM, requires_grad=True), torch.ones(MIN_DIM, MIN_DIM, requires_grad=True)
    try:
        with torch.enable_grad():
            fp8_linear(x, w).sum().backward()
    except RuntimeError:
        cap = os.environ.get("ONEDNN_MAX_CPU_ISA")
        capped = f"; ONEDNN_MAX_CPU_ISA={cap}" if cap else ""
        return f"this CPU's oneDNN has no fp8 matmul (it needs AVX512-FP16{capped})"
    return None


@torch.no_grad()
def quantise(t, dtype):
    """(t scaled into dtype's range and cast, the inverse scale): one scale for the whole tensor."""
    top = torch.finfo(dtype).max
    amax = t.float().abs().max()
    scale = (top / amax.double().clamp(min=1e-12)).float()  # in float64: compiled and eager give the same scale
    return (t.float() * scale).clamp(-top, top).to(dtype), scale.reciprocal()


def pad_rows(t):
    """t with zero rows up to a multiple of 16 (t itself when none are missing): CUDA's _scaled_mm wants its inner
    dim so, and dW's is the token count, which MoD packs to any number. Zero rows add exact zeros, keep the amax."""
    missing = -t.size(0) % MULTIPLE
    return torch.nn.functional.pad(t, (0, 0, 0, missing)) if missing else t


def column_major(t):
    """The same 2-D values laid out column by column: _scaled_mm wants its second operand so."""
    return t.t().contiguous().t()


class FP8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        """x (N, in) in the compute dtype, weight (out, in) fp32: x·Wᵀ (N, out) in x's dtype."""
        n = x.size(0)
        xq, x_inv = quantise(pad_rows(x), E4M3)  # padded for dW = dyᵀ·x; y takes the N real rows (M is free)
        wq, w_inv = quantise(weight, E4M3)
        ctx.save_for_backward(xq, x_inv, wq, w_inv)
        ctx.weight_dtype = weight.dtype
        # wq is (out, in) row-major, so wq.t() is already column-major: no copy
        return torch._scaled_mm(xq[:n], wq.t(), scale_a=x_inv, scale_b=w_inv, out_dtype=x.dtype, use_fast_accum=True)

    @staticmethod
    def backward(ctx, dy):
        xq, x_inv, wq, w_inv = ctx.saved_tensors
        n = dy.size(0)
        dyq, dy_inv = quantise(pad_rows(dy), E5M2)
        # exact accumulation in the backward: the gradients feed the optimizer's statistics
        dx = torch._scaled_mm(
            dyq[:n], column_major(wq), scale_a=dy_inv, scale_b=w_inv, out_dtype=dy.dtype, use_fast_accum=False
        )
        dw = torch._scaled_mm(
            dyq.t().contiguous(),
            column_major(xq),
            scale_a=dy_inv,
            scale_b=x_inv,
            out_dtype=dy.dtype,
            use_fast_accum=False,
        )
        return dx, dw.to(ctx.weight_dtype)


def opaque_to_compile():
    """FP8Matmul as one opaque node for torch.compile: it fuses around it, not into it. GPT.set_fp8(True) calls this,
    before any compile; not done at import, since registering imports torch._dynamo (over a second at every start)."""
    import torch._dynamo

    torch._dynamo.allow_in_graph(FP8Matmul)


def fp8_linear(x, weight):
    """x @ weight.T with fp8 matmuls, for any leading dims of x."""
    lead = x.shape[:-1]
    y = FP8Matmul.apply(x.reshape(-1, x.size(-1)), weight)
    return y.reshape(*lead, y.size(-1))
